"""Optimizer steps cut from the stream of every epoch's packs, dealt to the data-parallel ranks.

Each step takes the next ``world_size x micro_batches x packs_per_micro_batch`` packs of the global
order (an epoch's last packs and the next epoch's first may share a step: no pack is dropped or
repeated), deals them with balanced work and builds only this rank's. The stream's position is
global (the epoch, the next pack, the pieces of the epoch consumed), so a run resumes on another
number of ranks, micro-batches or plan settings (``load_state_dict``); docs/guides/operations.md
("What may change on resume") says what each change does.

>>> from thdpack.packing import PackedDataset
>>> samples = [{"input_ids": list(range(1, n + 1))} for n in (3, 5, 2, 6, 4, 7)]
>>> dataset = PackedDataset(samples, 8, dp_rank=1, dp_size=2, seed=0)   # DP rank 1 of 2
>>> step = dataset.step_stream(micro_batches=1, packs_per_micro_batch=1).next_step()
>>> step.tokens, step.capacity                    # the step's 2 packs (both ranks)
(15, 16)
>>> [pack["seq_lens"].tolist() for pack in step.micro_batches[0]]   # rank 1's pack
[[6, 2]]
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from thdpack._settings import check_int
from thdpack.packing.dealing import Balance, Epoch, Epochs, Imbalance, deal, imbalance, pack_costs
from thdpack.packing.packer import Pack
from thdpack.packing.pieces import Pieces, arrays_digest

STATE_FORMAT = "thdpack-step-stream"
STATE_VERSION = 2
"""Version 2 records the consumed pieces; version 1 (no ``format`` key) held the epoch, the
position and the settings only: it resumes with the settings that made it."""
_DEALING = ("packs_per_step", "balance")
"""The stream's own settings; the others are the plan's (``Epochs.fingerprint``)."""
_DATA = "num_sequences"


@dataclass(frozen=True)
class Step:
    """One optimizer step: this rank's micro-batches and the step's global counts."""

    epoch: int
    """Epoch of the step's first pack."""
    micro_batches: list[list[Pack]]
    """This rank's packs, ``micro_batches x packs_per_micro_batch``."""
    tokens: int
    """Real tokens of the whole step (all ranks)."""
    capacity: int
    """Token slots of the whole step (packs x pack_size)."""
    sequences: int
    """Sequences (pieces) of the whole step."""
    imbalance: Imbalance
    """max / mean work over the ranks."""
    packs_sha256: str
    """sha256 of the step's packs (all ranks'), in stream order: each pack's entries (sequence,
    start, length). Runs that train the same packs in a step have the same digest, whatever the
    data-parallel layout."""


def _digest(segments: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> str:
    sha = hashlib.sha256()
    for pack in segments:
        sha.update(np.stack(pack).astype("<i8").tobytes())
        sha.update(b"|")
    return sha.hexdigest()


@dataclass(frozen=True)
class StreamState:
    """Where a :class:`StepStream` stands: cheap to take after every step (the trainer's prefetch
    thread does); ``state_dict`` writes it out, with the consumed pieces, when a checkpoint saves it."""

    epoch: int
    position: int
    """The next pack of ``current``'s order."""
    current: Epoch | None
    """The epoch's plan in use (None: the start of the epoch's own plan, nothing consumed)."""
    lengths: np.ndarray
    """(S,) the data's sequence lengths."""
    settings: dict[str, Any]
    layout: dict[str, int]

    def consumed(self) -> Pieces:
        """The pieces of the epoch's sequences consumed so far (``Epoch.consumed``)."""
        return Pieces.empty() if self.current is None else self.current.consumed(self.position)

    def state_dict(self) -> dict[str, Any]:
        """Plain values and, under ``"arrays"``, numpy arrays (``thdpack.files.state_file`` writes
        them as JSON and ``.npz``, never pickled):

        - ``epoch``, ``position`` (in the plan in use, of ``plan_packs`` packs), ``replans`` (how
          often the rest of the epoch was planned again), ``settings`` (what defines the packs) and
          ``layout`` (data-parallel ranks, micro-batches, packs per micro-batch);
        - ``consumed``: the epoch's consumed pieces (``Pieces.to_arrays`` as ``arrays["consumed.*"]``),
          their counts and digest, and what ``remaining``;
        - after a re-plan, ``consumed_before``: the pieces consumed before the plan in use was made
          (what makes it again).
        """
        consumed = self.consumed()
        arrays = {f"consumed.{key}": value for key, value in consumed.to_arrays(self.lengths).items()}
        before = None if self.current is None else self.current.consumed_before
        if before is not None:
            arrays |= {f"consumed_before.{key}": value for key, value in before.to_arrays(self.lengths).items()}
        whole = consumed.count_whole(self.lengths)
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "replans": 0 if self.current is None else self.current.replans,
            "plan_packs": None if self.current is None else len(self.current),
            "settings": dict(self.settings),
            "layout": dict(self.layout),
            "consumed": {
                "sequences_whole": whole,
                "sequences_in_part": consumed.count_sequences() - whole,
                "tokens": consumed.tokens,
                "sha256": _pieces_digest(arrays, "consumed"),
            },
            "remaining": {
                "sequences": len(self.lengths) - whole,
                "tokens": int(self.lengths.sum()) - consumed.tokens,
            },
            "consumed_before": None if before is None else {"sha256": _pieces_digest(arrays, "consumed_before")},
            "arrays": arrays,
        }


def _pieces_digest(arrays: Mapping[str, np.ndarray], prefix: str) -> str:
    return arrays_digest({key: arrays[f"{prefix}.{key}"] for key in ("whole", "sample", "start", "length")})


def saved_pieces(state: Mapping[str, Any], prefix: str, lengths_S: np.ndarray) -> Pieces:
    """The pieces ``state["arrays"]`` holds under ``prefix`` (``"consumed"``, ``"consumed_before"``),
    checked against their recorded digest and the data's ``lengths_S``."""
    arrays = {key: state["arrays"][f"{prefix}.{key}"] for key in ("whole", "sample", "start", "length")}
    if arrays_digest(arrays) != state[prefix]["sha256"]:
        raise ValueError(f"the stream state's {prefix} pieces do not match their sha256: the record is damaged")
    return Pieces.from_arrays(arrays, lengths_S)


@dataclass(frozen=True)
class StreamChange:
    """What a resumed stream continues with, against the state it loaded (``load_state_dict``)."""

    epoch: int
    """The epoch the stream resumed in."""
    settings: dict[str, tuple[Any, Any]]
    """Plan settings, packs per step and balance that changed: ``{key: (saved, now)}``."""
    layout: dict[str, tuple[Any, Any]]
    """Data-parallel ranks, micro-batches, packs per micro-batch that changed."""
    replanned: int | None
    """Sequences of the epoch planned again, whole or their rest (None: no re-plan)."""
    message: str | None
    """One line: what changed and what it means for the data and the losses (None: nothing changed)."""


def _names(names: Mapping[str, str] | None) -> Callable[[str], str]:
    given = {"packs_per_step": "packs per step", "dp_size": "data-parallel size", **(names or {})}
    return lambda key: given.get(key, key)


def _shown(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _changes(diff: Mapping[str, tuple[Any, Any]], name: Callable[[str], str]) -> str:
    return ", ".join(f"{name(key)} {_shown(a)} -> {_shown(b)}" for key, (a, b) in diff.items())


class StepStream:
    """The steps of ``epochs`` for data-parallel ``rank`` of ``world_size``; stateful for exact resume.

    Made by ``PackedDataset.step_stream``; ``next_step()`` returns the next ``Step``,
    ``state_dict()`` / ``load_state_dict()`` save and restore the global position.

    Args:
        epochs: every epoch's plan and pack order (the same on every rank).
        build: ``build(epoch, index)`` makes the pack at ``index`` of the ``Epoch``'s order (only
            this rank's packs are built).
        rank: this data-parallel rank.
        world_size: the data-parallel ranks.
        balance: how a step's packs are dealt to the ranks (``dealing.pack_costs``).
        micro_batches: micro-batches per rank and step.
        packs_per_micro_batch: packs per micro-batch.
    """

    def __init__(
        self,
        epochs: Epochs,
        build: Callable[[Epoch, int], Pack],
        *,
        rank: int,
        world_size: int,
        balance: Balance,
        micro_batches: int,
        packs_per_micro_batch: int,
    ) -> None:
        self.micro_batches = check_int("micro_batches", micro_batches, 1)
        self.packs_per_micro_batch = check_int("packs_per_micro_batch", packs_per_micro_batch, 1)
        self.epochs, self.build, self.rank, self.world_size, self.balance = epochs, build, rank, world_size, balance
        self.packs_per_step = world_size * self.micro_batches * self.packs_per_micro_batch
        self.epoch = 0
        self.position = 0  # next pack of the current epoch's order
        self._rest: Epoch | None = None  # the rest of the current epoch planned again on resume

    def current(self) -> Epoch:
        """The plan of the epoch in progress: the epoch's own, or its rest planned again."""
        return self._rest if self._rest is not None else self.epochs[self.epoch]

    def _take(self) -> list[tuple[Epoch, int]]:
        """The next step's (epoch, pack index) references, advancing the stream."""
        refs: list[tuple[Epoch, int]] = []
        while len(refs) < self.packs_per_step:
            current = self.current()
            available = len(current) - self.position
            take = min(self.packs_per_step - len(refs), available)
            refs += [(current, self.position + i) for i in range(take)]
            self.position += take
            if take == available:
                self.epoch, self.position, self._rest = self.epoch + 1, 0, None
        return refs

    def next_step(self) -> Step:
        refs = self._take()
        segments = [epoch.segments(index) for epoch, index in refs]
        lengths = [segment[2] for segment in segments]
        hands = deal(pack_costs(lengths, self.balance), self.world_size)
        packs = [self.build(*refs[k]) for k in sorted(hands[self.rank])]  # in stream order: epoch by epoch
        per_micro = self.packs_per_micro_batch
        return Step(
            epoch=refs[0][0].number,
            micro_batches=[packs[m * per_micro : (m + 1) * per_micro] for m in range(self.micro_batches)],
            tokens=int(sum(int(x.sum()) for x in lengths)),
            capacity=self.packs_per_step * self.epochs.config.pack_size,
            sequences=int(sum(len(x) for x in lengths)),
            imbalance=imbalance(lengths, hands),
            packs_sha256=_digest(segments),
        )

    def fingerprint(self) -> dict[str, Any]:
        """The settings that define the stream: the same on every rank (the rank is not one)."""
        return {"packs_per_step": self.packs_per_step, "balance": self.balance, **self.epochs.fingerprint()}

    def layout(self) -> dict[str, int]:
        """How the packs per step are laid out; a resume may change it (``load_state_dict``)."""
        return {
            "dp_size": self.world_size,
            "micro_batches": self.micro_batches,
            "packs_per_micro_batch": self.packs_per_micro_batch,
        }

    def state(self) -> StreamState:
        """Where the stream stands (cheap: the consumed pieces are computed by its ``state_dict``)."""
        current = self._rest
        if current is None and self.position > 0:  # the epoch's own plan, held by `epochs` while in use
            current = self.epochs[self.epoch]
        return StreamState(
            epoch=self.epoch,
            position=self.position,
            current=current,
            lengths=self.epochs.lengths,
            settings=self.fingerprint(),
            layout=self.layout(),
        )

    def state_dict(self) -> dict[str, Any]:
        """``self.state().state_dict()``: where the stream stands, what it consumed, its settings."""
        return self.state().state_dict()

    def load_state_dict(self, state: Mapping[str, Any], *, names: Mapping[str, str] | None = None) -> StreamChange:
        """Continue where ``state`` (a ``state_dict``) stood, with this stream's settings (module
        docstring); returns what changed, with a one-line ``message``. ``names``: what the
        caller's users call each setting (``{"cp_size": "parallel.cp_size", ...}``), for the
        message and the errors. ``ValueError`` for a state of other data, or one that cannot
        continue with these settings (a version 1 state whose plan settings differ)."""
        name = _names(names)
        mine = self.fingerprint()
        versioned = state.get("format") == STATE_FORMAT
        saved = dict(state["settings"]) if versioned else {key: state.get(key) for key in mine}
        if saved.get(_DATA) != mine[_DATA]:
            raise ValueError(
                f"the saved data position is over {_shown(saved.get(_DATA))} sequences, and this data has "
                f"{mine[_DATA]:,}: it was saved on other data; resume on the data it was trained on"
            )
        settings = {key: (saved.get(key), value) for key, value in mine.items() if saved.get(key) != value}
        plan_changed = {key: pair for key, pair in settings.items() if key not in _DEALING}
        saved_layout = state.get("layout", {})
        layout = {k: (saved_layout[k], v) for k, v in self.layout().items() if saved_layout.get(k, v) != v}
        change = _changes({**settings, **layout}, name)
        if not plan_changed:
            self._continue(state)
            if settings:
                message: str | None = (
                    f"{change}: epoch {self.epoch}'s remaining {len(self.current()) - self.position:,} packs are the "
                    f"same, {self.packs_per_step} per step; losses will differ from an unchanged run"
                )
            elif layout:
                message = (
                    f"{change}: {name('packs_per_step')} stay {self.packs_per_step}, so the run continues with the "
                    "same packs in the same steps (losses equal an unchanged run's up to floating-point reduction "
                    "order)"
                )
            else:
                message = None
            return StreamChange(epoch=self.epoch, settings=settings, layout=layout, replanned=None, message=message)
        if not versioned:
            raise ValueError(
                f"the checkpoint's data position was saved without the sequences it consumed (an older thdpack), so "
                f"its epoch cannot be planned again with other settings ({change}); resume with the settings that "
                "made it"
            )
        epoch = int(state["epoch"])
        now = ", ".join(f"{name(key)}={_shown(value)}" for key, (_, value) in plan_changed.items())
        left = self._plan_rest(state)
        if left is None:
            message = f"{change}: epoch {epoch} (not begun) and the later ones are planned with {now}"
        elif left == 0:
            message = f"{change}: epoch {epoch} was consumed; epoch {epoch + 1} on is planned with {now}"
        else:
            message = (
                f"{change}: the remaining {left:,} sequences of epoch {epoch} are planned again with {now}; losses "
                "will differ from an unchanged run"
            )
        return StreamChange(epoch=epoch, settings=settings, layout=layout, replanned=left, message=message)

    def _continue(self, state: Mapping[str, Any]) -> None:
        """Stand where ``state`` stood, in the same plan: the epoch's own, or its rest planned again
        from the same consumed pieces with the same settings; ``ValueError`` when that plan is not
        the saved one."""
        self.epoch, self.position, self._rest = int(state["epoch"]), int(state["position"]), None
        replans = int(state.get("replans", 0))
        if replans:
            before = saved_pieces(state, "consumed_before", self.epochs.lengths)
            self._rest = self.epochs.rest(self.epoch, before, replans=replans)
        saved_packs = state.get("plan_packs")
        if saved_packs is not None and len(self.current()) != saved_packs:
            rest = "" if self._rest is None else " (its rest, planned again)"
            raise ValueError(
                f"epoch {self.epoch}'s plan{rest} has {len(self.current()):,} packs with the saved settings, the saved "
                f"one {saved_packs:,}: the plan is not reproducible here (another thdpack version?); resume with the "
                "thdpack that saved it"
            )

    def _plan_rest(self, state: Mapping[str, Any]) -> int | None:
        """Continue the saved epoch with the pieces it has not consumed planned again with this
        stream's settings; returns how many sequences that plan holds (whole or their rest: 0 when the
        epoch was consumed, the stream then at the next one), None when the epoch had not begun (its
        own plan, as a fresh run with these settings makes it)."""
        epoch, replans = int(state["epoch"]), int(state.get("replans", 0))
        consumed = saved_pieces(state, "consumed", self.epochs.lengths)
        self.epoch, self.position, self._rest = epoch, 0, None
        if not len(consumed):
            return None
        rest = self.epochs.rest(epoch, consumed, replans=replans + 1)
        if rest is None:
            self.epoch += 1
            return 0
        self._rest = rest
        assert rest.items is not None
        return rest.items.count_sequences()
