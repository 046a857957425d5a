"""Packs for the THD / CP / mask tests: the spec's worked examples and a hypothesis strategy.

``make_pack`` writes a pack in CONTRACT.md's format independently of thdpack, so the tests
check thdpack against a second implementation of the layout rules.
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

PAD_ID = 0


def make_pack(
    seqs: list[list[int]],
    pack_size: int,
    *,
    cp_size: int = 1,
    labels: list[list[int]] | None = None,
    pad_id: int = PAD_ID,
    with_truth: bool = False,
) -> dict[str, torch.Tensor]:
    """A pack of ``seqs`` (labels default to the tokens); ``with_truth`` adds ``is_padding`` (L,) bool."""
    step = 2 * cp_size if cp_size > 1 else 1
    labels = seqs if labels is None else labels
    input_ids, label_ids, positions, is_padding = [], [], [], []
    seq_lens, seq_lens_padded = [], []
    for seq, lab in zip(seqs, labels, strict=True):
        width = math.ceil(len(seq) / step) * step
        pad = width - len(seq)
        input_ids += [*seq, *[pad_id] * pad]
        label_ids += [*lab, *[-100] * pad]
        positions += range(width)
        is_padding += [False] * len(seq) + [True] * pad
        seq_lens.append(len(seq))
        seq_lens_padded.append(width)
    tail = pack_size - len(input_ids)
    assert tail >= 0, f"sequences need {len(input_ids)} slots, over pack_size={pack_size}"
    input_ids += [pad_id] * tail
    label_ids += [-100] * tail
    positions += range(positions[-1] + 1, positions[-1] + 1 + tail)
    is_padding += [True] * tail
    seq_lens_padded[-1] += tail
    pack = {
        "input_ids": torch.tensor(input_ids),
        "labels": torch.tensor(label_ids),
        "position_ids": torch.tensor(positions),
        "seq_lens": torch.tensor(seq_lens),
        "seq_lens_padded": torch.tensor(seq_lens_padded),
    }
    if with_truth:
        pack["is_padding"] = torch.tensor(is_padding)
    return pack


BASE = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
P1 = [make_pack(BASE[:3], 10), make_pack(BASE[3:], 10)]  # nemo_te_spec.md P1 (two packs)
P5 = make_pack([[1, 2, 3], [4, 5, 6, 7, 8]], 16, cp_size=2)
P6 = make_pack([[1, 2, 3], [4, 5], [6]], 20, cp_size=2)
C1_SECOND = make_pack([[1, 2, 3], [4, 5], [6]], 16, cp_size=2)  # C1's second pack
S3 = make_pack([[11, 12, 13, 14, 15], [21, 22, 23]], 16, cp_size=4, labels=[[12, 13, 14, 15, -100], [22, 23, -100]])


@st.composite
def pack_batches(draw: st.DrawFn, *, cp_size: int | None = None, max_rows: int = 3, max_pack: int = 48):
    """(packs, cp_size): 1..max_rows packs of one pack_size (a multiple of 2*cp_size), with truth.

    Tokens come from {0, 1, 2, 3}, so the pad id 0 often occurs as real content; every label
    of a real token is ``7 * token + 1`` so label/token alignment is checkable after any
    permutation.
    """
    cp = draw(st.integers(1, 4)) if cp_size is None else cp_size
    step = 2 * cp if cp > 1 else 1
    pack_size = step * draw(st.integers(1, max(1, max_pack // step)))
    packs = []
    for _ in range(draw(st.integers(1, max_rows))):
        seqs: list[list[int]] = []
        used = 0
        for _ in range(draw(st.integers(1, 5))):
            room = pack_size - used
            if room == 0:
                break
            n = draw(st.integers(1, room))
            seqs.append(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)))
            used += math.ceil(n / step) * step
        labels = [[7 * t + 1 for t in seq] for seq in seqs]
        packs.append(make_pack(seqs, pack_size, cp_size=cp, labels=labels, with_truth=True))
    return packs, cp
