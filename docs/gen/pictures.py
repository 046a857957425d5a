"""The concepts page's pictures, drawn from what thdpack itself computes.

Each picture runs the library on a small example (``plan_packs`` -> ``build_pack`` /
``pack_from_segments`` -> ``thd_collate`` -> ``cp.shard``) and draws the result as SVG: one
square per token, coloured by its sequence, lighter where it is padding. A rank's row is the
tokens ``cp.shard`` gives it, found by ``thdpack.layout.rank_indices`` and checked against the
shard itself, so a picture cannot show a layout the code does not make. ``text`` gives the arrays
behind each picture for the page's code blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from html import escape

import numpy as np

CELL = 24  # px per token
COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#9c755f")
PADDING = "#d9d9d9"
LETTERS = "ABCDEFGH"


@dataclass(frozen=True)
class Example:
    """A THD batch of one pack and what the pictures need of it (numpy)."""

    thd: dict
    lengths_S: np.ndarray  # real tokens per entry (padding entries: 0)
    slots_S: np.ndarray  # cu_seqlens_padded differences
    group_size_S: np.ndarray | None
    group_start_S: np.ndarray | None
    cp_size: int
    names_S: tuple[str, ...]  # "A", "B", ... ("pad" for a placed pack's padding entries)

    def entry_of_token(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.slots_S)), self.slots_S)

    def real_token(self) -> np.ndarray:
        offset_T = np.arange(int(self.slots_S.sum())) - np.repeat(np.cumsum(self.slots_S) - self.slots_S, self.slots_S)
        return offset_T < np.repeat(self.lengths_S, self.slots_S)

    def rank_tokens(self, rank: int) -> np.ndarray:
        """Rank ``rank``'s global token indices, checked against ``cp.shard``."""
        from thdpack.cp import shard
        from thdpack.layout import rank_indices

        index_T = rank_indices(self.slots_S, self.cp_size, rank, self.group_size_S, self.group_start_S)
        local = shard(self.thd, cp_size=self.cp_size, cp_rank=rank)
        assert local["input_ids"].tolist() == self.thd["input_ids"][index_T].tolist(), "rank_indices != cp.shard"
        return index_T


def _samples(lengths: list[int]) -> list[dict]:
    """Sample ``i`` holds tokens 10*(i+1), 10*(i+1)+1, ...: a token's sequence shows in its id."""
    return [{"input_ids": list(range(10 * (i + 1), 10 * (i + 1) + n))} for i, n in enumerate(lengths)]


@cache
def planned(cp_size: int) -> Example:
    """Sequences of 5, 3 and 6 tokens in one pack, planned and laid out as thdpack does for ``cp_size``."""
    from thdpack import plan_packs, thd_collate
    from thdpack.packing import build_pack

    lengths = [5, 3, 6]
    pack_size = 16 if cp_size == 1 else 24
    plan = plan_packs(lengths, pack_size, cp_size=cp_size, algorithm="sequential")
    thd = thd_collate([build_pack(_samples(lengths), plan, 0)])
    padded = thd["cu_seqlens_padded"].numpy()
    real = thd["cu_seqlens"].numpy()
    return Example(thd, np.diff(real), np.diff(padded), None, None, cp_size, tuple(LETTERS[: len(lengths)]))


@cache
def placed() -> Example:
    """The design note's worked example: cp 4, a 48-token pack, A split over all ranks, B over
    ranks 2-3, C, D, E, F whole (``PackPlacement.from_groups``)."""
    from thdpack import thd_collate
    from thdpack.layout import PackPlacement
    from thdpack.packing.packer import pack_from_segments

    lengths = [10, 7, 5, 3, 2, 1]
    groups = {(0, 4): [0], (2, 2): [1], (0, 1): [2], (1, 1): [3, 5], (2, 1): [4]}
    placement = PackPlacement.from_groups(lengths, groups, cp_size=4, pack_size=48)
    segments = (list(range(6)), [0] * 6, lengths)
    pack = pack_from_segments(_samples(lengths), segments, 48, cp_size=4, placement=placement)
    thd = thd_collate([pack])
    layout = placement.layout()
    names = (*LETTERS[:6], *(f"pad{r}" for r in range(4)))
    return Example(thd, layout.lengths_S, layout.slots_S, layout.group_size_S, layout.group_start_S, 4, names)


# -- drawing -----------------------------------------------------------------------------------------
def _cell(x: float, y: float, colour: str, label: str, light: bool) -> str:
    opacity = 0.35 if light else 1.0
    text_colour = "#333" if light else "#fff"
    return (
        f'<rect x="{x}" y="{y}" width="{CELL - 2}" height="{CELL - 2}" rx="3" fill="{colour}" '
        f'fill-opacity="{opacity}"/>'
        f'<text x="{x + (CELL - 2) / 2}" y="{y + CELL / 2 + 2}" font-size="10" text-anchor="middle" '
        f'fill="{text_colour}">{escape(label)}</text>'
    )


def _caption(x: float, y: float, text: str, anchor: str = "end", size: int = 11) -> str:
    return f'<text x="{x}" y="{y}" font-size="{size}" text-anchor="{anchor}" fill="#333">{escape(text)}</text>'


def _colour(example: Example, entry: int) -> str:
    return PADDING if example.names_S[entry].startswith("pad") else COLOURS[entry % len(COLOURS)]


def _row(example: Example, y: float, tokens_T: np.ndarray, labels: list[str], left: float) -> list[str]:
    entry_T, real_T = example.entry_of_token(), example.real_token()
    out = []
    for i, (t, label) in enumerate(zip(tokens_T.tolist(), labels, strict=True)):
        e = int(entry_T[t])
        colour = _colour(example, e) if real_T[t] or example.group_size_S is not None else COLOURS[e % len(COLOURS)]
        out.append(_cell(left + i * CELL, y, colour, label, light=not real_T[t]))
    return out


def _svg(width: float, height: float, body: list[str]) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">' + "".join(body) + "</svg>\n"
    )


def _boundaries(example: Example, y: float, left: float, cu: np.ndarray, name: str, above: bool) -> list[str]:
    out = [_caption(left - 8, y + 4, name)]
    for value in cu.tolist():
        x = left + value * CELL - 1
        tick = (y - 6, y + 6)
        out.append(f'<line x1="{x}" y1="{tick[0]}" x2="{x}" y2="{tick[1]}" stroke="#333" stroke-width="2"/>')
        out.append(_caption(x, y - 8 if above else y + 18, str(value), anchor="middle", size=10))
    return out


def pack_picture(cp_size: int) -> str:
    """A pack's tokens (ids), with ``position_ids`` and ``labels`` under them and the boundaries
    ``cu_seqlens`` (real tokens) and ``cu_seqlens_padded`` (slots) around them."""
    ex = planned(cp_size)
    thd = ex.thd
    T = len(thd["input_ids"])
    left, top = 130, 34
    all_T = np.arange(T)
    body = _boundaries(ex, top - 10, left, thd["cu_seqlens_padded"].numpy(), "cu_seqlens_padded", above=True)
    rows = (("input_ids", thd["input_ids"]), ("position_ids", thd["position_ids"]), ("labels", thd["labels"]))
    y = top
    for name, values in rows:
        body.append(_caption(left - 8, y + CELL / 2 + 2, name))
        shown = ["·" if v == -100 else str(v) for v in values.tolist()]
        body += _row(ex, y, all_T, shown, left)
        y += CELL + 4
    body += _boundaries(ex, y + 8, left, thd["cu_seqlens"].numpy(), "cu_seqlens", above=False)
    return _svg(left + T * CELL + 10, y + 40, body)


def ranks_picture(example: Example) -> str:
    """The global batch (each token labelled with its index), then every CP rank's shard: the
    global tokens it holds, in its local order."""
    T = int(example.slots_S.sum())
    left, y = 70, 8
    all_T = np.arange(T)
    body = [_caption(left - 8, y + CELL / 2 + 2, "global")]
    body += _row(example, y, all_T, [str(t) for t in all_T.tolist()], left)
    y += CELL + 14
    for rank in range(example.cp_size):
        tokens = example.rank_tokens(rank)
        body.append(_caption(left - 8, y + CELL / 2 + 2, f"rank {rank}"))
        body += _row(example, y, tokens, [str(t) for t in tokens.tolist()], left)
        y += CELL + 4
    legend_x = left
    for e, name in enumerate(example.names_S):
        if name.startswith("pad") and name != "pad0":
            continue
        label = "padding" if name.startswith("pad") else f"sequence {name}"
        body.append(_cell(legend_x, y + 6, _colour(example, e), "", light=False))
        body.append(_caption(legend_x + CELL + 2, y + 6 + CELL / 2 + 2, label, anchor="start"))
        legend_x += CELL + 12 + 7 * len(label)
    if example.group_size_S is None:  # TE's layout: a sequence's padding is its own colour, lighter
        body.append(_cell(legend_x, y + 6, COLOURS[0], "", light=True))
        body.append(_caption(legend_x + CELL + 2, y + 6 + CELL / 2 + 2, "padding (lighter)", anchor="start"))
        legend_x += CELL + 12 + 7 * len("padding (lighter)")
    return _svg(max(left + T * CELL + 10, legend_x), y + CELL + 14, body)


def files() -> list[tuple[str, str]]:
    """``(path under docs/, SVG)`` of every picture."""
    return [
        ("img/pack.svg", pack_picture(1)),
        ("img/pack_cp2.svg", pack_picture(2)),
        ("img/te_chunks.svg", ranks_picture(planned(2))),
        ("img/placed.svg", ranks_picture(placed())),
    ]


# -- the arrays behind the pictures ----------------------------------------------------------------
def _listed(values) -> str:
    return str(np.asarray(values).tolist())


def text(name: str) -> str:
    """A code block of the arrays behind picture ``name`` (``pack``, ``pack_cp2``, ``te_chunks``, ``placed``)."""
    if name in ("pack", "pack_cp2"):
        thd = planned(1 if name == "pack" else 2).thd
        keys = ("input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_padded", "max_seqlen")
        lines = [f"{k:<18} {_listed(thd[k]) if k != 'max_seqlen' else thd[k]}" for k in keys]
    elif name in ("te_chunks", "placed"):
        ex = planned(2) if name == "te_chunks" else placed()
        lines = [
            f"{'cu_seqlens':<18} {_listed(ex.thd['cu_seqlens'])}",
            f"{'cu_seqlens_padded':<18} {_listed(ex.thd['cu_seqlens_padded'])}",
        ]
        if ex.group_size_S is not None:
            lines += [
                f"{'cp_group_size':<18} {_listed(ex.group_size_S)}",
                f"{'cp_group_start':<18} {_listed(ex.group_start_S)}",
            ]
        lines += [f"{f'rank {r}':<18} {_listed(ex.rank_tokens(r))}" for r in range(ex.cp_size)]
    else:
        raise KeyError(f"no concepts picture {name!r}")
    return "```text\n" + "\n".join(lines) + "\n```"
