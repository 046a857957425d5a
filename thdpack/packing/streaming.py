"""StreamingPacker: pack an endless or huge stream of samples with a bounded buffer.

Whenever its buffer of ``buffer_size`` sequences is full (or the stream ends) it emits one pack:
the *oldest* buffered sequence opens it, which bounds how long any sequence waits, and the rest
of its room is filled from the buffer by the improvement phase's exact-fill rules
(``thdpack.plan.improve.SizePool.fill``). Slots are CP-aware and ``plan_packs``' overflow
policies apply, counted in ``stats``. ``state_dict()`` holds the buffered tokens, the stats and
the source's position (its own ``state_dict`` when it has one, else the samples consumed, which a
fresh ``iter(source)`` must replay). Each DataLoader worker and each DP rank packs what its
source yields: shard the source per worker and rank. ``StreamingPacker(source, pack_size,
**keywords)`` takes every setting of ``StreamingPackerConfig`` by name; ``config.build(source,
runtime)`` is a call of it.

>>> stream = [{"input_ids": list(range(n))} for n in (5, 2, 6, 3, 4)]
>>> packer = StreamingPacker(stream, 8, buffer_size=4)
>>> [p["seq_lens"].tolist() for p in packer]
[[5, 3], [2, 6], [4]]
>>> packer.stats.num_packs, packer.stats.real_tokens
(3, 20)
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from thdpack._config_forms import FlatKeywords, Part, flat_values
from thdpack._settings import Settings, integer, one_of, setting
from thdpack.layout.rules import check_pack_size, cp_multiple, round_up_to_cp
from thdpack.packing.packer import Pack, SampleTokens, assemble_pack, read_sample
from thdpack.packing.runtime import PackingRuntime
from thdpack.packing.saved_settings import check_saved_settings
from thdpack.plan.config import check_pack_size_setting
from thdpack.plan.improve import SizePool
from thdpack.plan.overflow import OVERFLOW_COUNTS, OVERFLOWS, Overflow, apply_overflow
from thdpack.plan.packing_stats import PackingStats, build_stats

_END = object()  # end-of-stream marker (a source may yield anything, even None, and be told so)


@dataclass(frozen=True, kw_only=True)
class StreamingPackerConfig(Settings):
    """Settings of a ``StreamingPacker`` (the CP size and the pad id come from the run: ``build``)."""

    pack_size: int = setting(
        "Tokens per pack (a multiple of 2*cp_size when cp_size > 1).", check=check_pack_size_setting
    )
    buffer_size: int = setting(
        "Sequences held before a pack is emitted; larger packs tighter and uses more memory.",
        default=1024,
        check=integer(1),
    )
    overflow: Overflow = setting(
        "Sequences longer than pack_size: 'error', 'drop', 'truncate' or 'split' (counted in stats).",
        default="error",
        check=one_of(OVERFLOWS, "overflow policy"),
    )

    def build(self, source: Iterable[Mapping[str, Any]], runtime: PackingRuntime = PackingRuntime()) -> StreamingPacker:
        """The packer of ``source`` with these settings and the run's ``runtime`` (its ``cp_size`` and
        ``pad_id``): ``StreamingPacker`` with both as keywords."""
        if not isinstance(runtime, PackingRuntime):
            raise TypeError(f"runtime must be a thdpack.packing.PackingRuntime, got {type(runtime).__name__}")
        return StreamingPacker(source, **flat_values(self), cp_size=runtime.cp_size, pad_id=runtime.pad_id)


PACKER_KEYWORDS = FlatKeywords(
    "StreamingPacker", [Part(StreamingPackerConfig), Part(PackingRuntime, only=("cp_size", "pad_id"))]
)
"""``StreamingPacker``'s keywords: every field of its config, and the runtime's CP size and pad id."""


@dataclass
class _Entry:
    """A buffered sequence or piece of one."""

    index: int
    """Position of its sample in the stream."""
    start: int
    """Token offset inside the sample (0 unless overflow cut it)."""
    tokens: SampleTokens
    slots: int
    """Length rounded up to a multiple of 2*cp_size."""


# Running totals behind ``stats``: the arguments of ``thdpack.plan.packing_stats.build_stats`` that add up
# pack by pack (plain ints, so they checkpoint as they are), plus the overflow counts.
_TOTALS = ("num_packs", "num_sequences", "num_entries", "real_tokens", "max_sequences_per_pack", *OVERFLOW_COUNTS)


class StreamingPacker(torch.utils.data.IterableDataset):
    """Packs (``Pack`` dicts, as ``PackedDataset`` builds them) from an iterable of samples.

    ``source`` is any iterable of mappings with ``input_ids`` (optional ``labels``,
    ``loss_mask``). Iterating continues from the current state; once the stream has ended and
    the buffer is drained, the next ``iter()`` starts a new pass over ``source``.
    """

    @PACKER_KEYWORDS.document
    def __init__(self, source: Iterable[Mapping[str, Any]], pack_size: int, **keywords: Any) -> None:
        """The packs of ``source`` in ``pack_size`` tokens, with every other setting and the run's
        ``cp_size`` / ``pad_id`` by keyword (below).

        Args:
            source: an iterable of samples (``input_ids``, optional ``labels`` or ``loss_mask``).
            pack_size: tokens per pack; a multiple of ``2*cp_size`` under context parallelism.
            **keywords: ``StreamingPackerConfig``'s and ``PackingRuntime``'s fields by name.
        """
        config, runtime = PACKER_KEYWORDS.build(pack_size=pack_size, **keywords)
        check_pack_size(config.pack_size, runtime.cp_size)
        self.config: StreamingPackerConfig = config
        self.runtime: PackingRuntime = runtime
        self.source = source
        self._reset()

    def _reset(self) -> None:
        self._entries: dict[int, _Entry] = {}  # arrival id -> entry; dict order = arrival order
        self._by_slots: list[tuple[int, int]] = []  # sorted (slots, arrival id)
        multiple = cp_multiple(self.runtime.cp_size)
        self._pool = SizePool({}, self.config.pack_size // multiple)
        """The buffer's slot counts in units of 2*cp_size: what a pack's exact fill chooses from."""
        self._over_half = 0
        """Buffered entries longer than half a pack (see ``_emit``)."""
        self._next_arrival = 0
        self._consumed = 0
        self._exhausted = False
        self._finished = False
        self._source_state: Any = None
        self._totals: dict[str, int] = dict.fromkeys(_TOTALS, 0)
        self._slot_units: dict[int, int] = {}
        """Placed entries per slot size (in multiples of 2*cp_size), for the L2 lower bound."""
        self._pack_loads: dict[int, int] = {}
        """Packs per real-token load, for the fullness percentiles."""

    # -- the buffer ----------------------------------------------------------------------
    def _add(self, index: int, start: int, tokens: SampleTokens) -> None:
        slots = int(round_up_to_cp(len(tokens), self.runtime.cp_size))
        arrival = self._next_arrival
        self._next_arrival += 1
        self._entries[arrival] = _Entry(index, start, tokens, slots)
        bisect.insort(self._by_slots, (slots, arrival))
        self._pool.add(slots // cp_multiple(self.runtime.cp_size))
        self._over_half += 2 * slots > self.config.pack_size

    def _take(self, arrival: int) -> _Entry:
        entry = self._entries.pop(arrival)
        self._over_half -= 2 * entry.slots > self.config.pack_size
        del self._by_slots[bisect.bisect_left(self._by_slots, (entry.slots, arrival))]
        return entry

    def _intake(self, sample: Mapping[str, Any], index: int) -> None:
        """Validate one sample and buffer it (or its pieces), applying the overflow policy."""
        tokens = read_sample(sample, index)
        cfg = self.config
        entries = apply_overflow(np.array([len(tokens)]), cfg.pack_size, cfg.overflow, first_index=index)
        for key in OVERFLOW_COUNTS:
            self._totals[key] += getattr(entries, key)
        starts = np.zeros(len(entries.length), dtype=np.int64) if entries.start is None else entries.start
        for start, length in zip(starts.tolist(), entries.length.tolist(), strict=True):
            self._add(index, start, tokens if length == len(tokens) else tokens.piece(start, length))

    def _emit(self) -> Pack:
        """Remove one pack's entries from the buffer (the oldest, then an exact fill of the rest:
        the oldest entries of each chosen size, largest first) and build it."""
        cfg = self.config
        multiple = cp_multiple(self.runtime.cp_size)
        oldest = next(iter(self._entries))
        # A pack holds at most one entry over half a pack, which takes a short entry beside it,
        # and closing the last gap takes another. Where short entries do not arrive at least
        # twice as often as long ones (uniform lengths), closing every gap would use them up and
        # leave a buffer of long entries that share no pack: gaps are closed only while the
        # buffer holds at least twice as many entries of at most half a pack as longer ones
        # (otherwise the pack is the best fit the greedy found, as without exact fills).
        close = len(self._entries) - self._over_half >= 2 * self._over_half
        units = self._pool.fill(self._entries[oldest].slots // multiple, close=close)
        self._pool.take(units)
        chosen = [self._take(oldest)]
        units[chosen[0].slots // multiple] -= 1
        for size, count in sorted(units.items(), reverse=True):
            for _ in range(count):
                slots = size * multiple
                chosen.append(self._take(self._by_slots[bisect.bisect_left(self._by_slots, (slots, -1))][1]))
        totals = self._totals
        load = sum(len(e.tokens) for e in chosen)
        totals["num_packs"] += 1
        totals["num_entries"] += len(chosen)
        totals["num_sequences"] += sum(e.start == 0 for e in chosen)
        totals["real_tokens"] += load
        totals["max_sequences_per_pack"] = max(totals["max_sequences_per_pack"], len(chosen))
        for e in chosen:
            self._slot_units[e.slots // multiple] = self._slot_units.get(e.slots // multiple, 0) + 1
        self._pack_loads[load] = self._pack_loads.get(load, 0) + 1
        return assemble_pack(
            [e.tokens for e in chosen], cfg.pack_size, cp_size=self.runtime.cp_size, pad_id=self.runtime.pad_id
        )

    # -- iteration -----------------------------------------------------------------------
    def _open_source(self) -> Iterator[Mapping[str, Any]]:
        if self._has_source_state():
            if self._source_state is not None:
                self.source.load_state_dict(self._source_state)  # type: ignore[attr-defined]
            return iter(self.source)
        it = iter(self.source)
        skipped = sum(1 for _ in itertools.islice(it, self._consumed))
        if skipped < self._consumed:
            raise ValueError(
                f"the source ended after {skipped} samples while skipping the {self._consumed} "
                "consumed before the checkpoint; resume needs a source that replays the same samples"
            )
        return it

    def _has_source_state(self) -> bool:
        return hasattr(self.source, "state_dict") and hasattr(self.source, "load_state_dict")

    def __iter__(self) -> Iterator[Pack]:
        if self._finished:
            self._reset()
        it = None if self._exhausted else self._open_source()
        self._source_state = None  # restored (if any); from now on the live source holds its state
        while True:
            while it is not None and len(self._entries) < self.config.buffer_size:
                sample = next(it, _END)
                if sample is _END:
                    self._exhausted, it = True, None
                    break
                self._intake(sample, self._consumed)
                self._consumed += 1
            if not self._entries:
                break
            yield self._emit()
        self._finished = True

    # -- statistics ----------------------------------------------------------------------
    @property
    def stats(self) -> PackingStats:
        """Statistics of the packs emitted so far (overflow counts include samples still buffered)."""
        cfg = self.config
        sizes = np.array(sorted(self._slot_units), dtype=np.int64)
        loads = np.array(sorted(self._pack_loads), dtype=np.int64)
        return build_stats(
            algorithm=f"streaming exact fill (buffer {cfg.buffer_size})",
            pack_size=cfg.pack_size,
            cp_size=self.runtime.cp_size,
            slot_sizes=sizes,
            slot_counts=np.array([self._slot_units[int(v)] for v in sizes], dtype=np.int64),
            pack_loads=(loads, np.array([self._pack_loads[int(v)] for v in loads], dtype=np.int64)),
            overflow=self._totals,
            **{key: self._totals[key] for key in _TOTALS if key not in OVERFLOW_COUNTS},
        )

    # -- checkpointing -------------------------------------------------------------------
    def _fingerprint(self) -> dict[str, Any]:
        # the rule that picks a pack's entries decides the packs a resumed stream emits: a state
        # saved under another rule (best fit, before the exact fills) must not resume silently
        return {**self.config.fingerprint(), "cp_size": self.runtime.cp_size, "fill": "oldest + exact fill"}

    def state_dict(self) -> dict[str, Any]:
        """Buffered tokens, counters and the source position (see the module docstring)."""
        entries = list(self._entries.values())
        empty = np.zeros(0, dtype=np.int64)
        source = None
        if self._has_source_state():  # a restored state not yet handed to the source is still the position
            source = self._source_state if self._source_state is not None else self.source.state_dict()  # type: ignore[attr-defined]
        return {
            "config": self._fingerprint(),
            "consumed": self._consumed,
            "exhausted": self._exhausted,
            "finished": self._finished,
            "source": source,
            "buffer_index": torch.tensor([e.index for e in entries], dtype=torch.int64),
            "buffer_start": torch.tensor([e.start for e in entries], dtype=torch.int64),
            "buffer_length": torch.tensor([len(e.tokens) for e in entries], dtype=torch.int64),
            "buffer_input_ids": torch.from_numpy(np.concatenate([empty] + [e.tokens.input_ids for e in entries])),
            "buffer_labels": torch.from_numpy(np.concatenate([empty] + [e.tokens.labels for e in entries])),
            "totals": dict(self._totals),
            "slot_units": dict(self._slot_units),
            "pack_loads": dict(self._pack_loads),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a ``state_dict()``; raises ``ValueError`` when it was saved with other settings."""
        if "totals" not in state:
            raise ValueError(
                "this StreamingPacker state was saved by an older thdpack (its statistics were 'counters'); "
                "resume with the thdpack version that saved it, or restart the stream"
            )
        check_saved_settings("StreamingPacker", state["config"], self._fingerprint())
        if (state["source"] is not None) != self._has_source_state() and not state["finished"]:
            saved = "with" if state["source"] is not None else "without"
            raise ValueError(
                f"state was saved {saved} a source state_dict, but this source "
                f"{'lacks' if state['source'] is not None else 'has'} state_dict/load_state_dict; "
                "resume with the same kind of source"
            )
        self._reset()
        self._consumed = int(state["consumed"])
        self._exhausted = bool(state["exhausted"])
        self._finished = bool(state["finished"])
        self._source_state = state["source"]
        lengths = state["buffer_length"].tolist()
        ends = np.cumsum(lengths, dtype=np.int64)
        input_ids = state["buffer_input_ids"].numpy().astype(np.int64, copy=False)
        labels = state["buffer_labels"].numpy().astype(np.int64, copy=False)
        for index, start, end, length in zip(
            state["buffer_index"].tolist(),
            state["buffer_start"].tolist(),
            ends.tolist(),
            lengths,
            strict=True,
        ):
            self._add(index, start, SampleTokens(input_ids[end - length : end], labels[end - length : end]))
        self._totals = {key: int(state["totals"][key]) for key in _TOTALS}
        self._slot_units = {int(k): int(v) for k, v in state["slot_units"].items()}
        self._pack_loads = {int(k): int(v) for k, v in state["pack_loads"].items()}
