"""PackPlan: which sequences share each pack, stored as flat indices + offsets.

>>> plan = PackPlan(np.array([2, 0, 1]), np.array([0, 2, 3]), sequence_lengths=np.array([3, 5, 4]),
...                 pack_size=8, cp_size=1, algorithm="bfd", seed=None, stats=None)
>>> len(plan), plan[0].tolist(), plan[1].tolist()
(2, [2, 0], [1])
>>> plan.segments(0)   # (sequence indices, token starts, token lengths)
(array([2, 0]), array([0, 0]), array([4, 3]))
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from thdpack.layout.placement import CpPlacement
from thdpack.plan.packing_stats import PackingStats

FORMAT = "thdpack.PackPlan/1"


def _compact(array: np.ndarray) -> np.ndarray:
    """The smallest unsigned/signed dtype that holds ``array`` exactly (for saving)."""
    if len(array) == 0:
        return array.astype(np.int32)
    lo, hi = int(array.min()), int(array.max())
    for dtype in (np.uint16, np.int32, np.int64):
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return array.astype(dtype)
    return array


class PackPlan:
    """Packs of sequence indices. ``plan[i]`` is pack ``i``: (k,) int64 indices in placement order.

    Most plans place whole sequences. With ``overflow="truncate"`` or ``"split"`` an entry can
    be part of a sequence: ``segments(i)`` gives each entry's token start and length. The planner
    makes plans (``plan_packs``); ``PackPlan.load`` reads a saved one.

    Args:
        indices: (E,) sequence index of every entry, pack by pack.
        offsets: (num_packs+1,) pack boundaries in ``indices``.
        sequence_lengths: the input lengths (all sequences, dropped ones included).
        pack_size: tokens per pack.
        cp_size: the context-parallel size the plan is laid out for.
        algorithm: the planner that made it.
        seed: its seed.
        stats: its ``PackingStats``.
        entry_starts: (E,) token offset of each entry in its sequence (None: every entry starts at 0).
        entry_lengths: (E,) tokens of each entry (None: every entry is a whole sequence).
        placement: the ``CpPlacement`` of a per-sequence placement (None: TE's layout).
        cost_model: what the placement balanced.
        a2a_packs: (num_packs,) True for the packs an ``auto`` plan attends by all-to-all.
    """

    def __init__(
        self,
        indices: np.ndarray,
        offsets: np.ndarray,
        *,
        sequence_lengths: np.ndarray,
        pack_size: int,
        cp_size: int,
        algorithm: str,
        seed: int | None,
        stats: PackingStats | None,
        entry_starts: np.ndarray | None = None,
        entry_lengths: np.ndarray | None = None,
        placement: CpPlacement | None = None,
        cost_model: str | None = None,
        a2a_packs: np.ndarray | None = None,
    ) -> None:
        self.indices = np.asarray(indices, dtype=np.int64)
        """(E,) sequence index of every entry, pack by pack."""
        self.offsets = np.asarray(offsets, dtype=np.int64)
        """(num_packs+1,) pack boundaries in ``indices``."""
        self.sequence_lengths = np.asarray(sequence_lengths, dtype=np.int64)
        """(num_sequences_in,) the input lengths (all sequences, dropped ones included)."""
        self.entry_starts = None if entry_starts is None else np.asarray(entry_starts, dtype=np.int64)
        """(E,) token offset of each entry in its sequence, or None when every entry starts at 0."""
        self.entry_lengths = None if entry_lengths is None else np.asarray(entry_lengths, dtype=np.int64)
        """(E,) tokens of each entry, or None when every entry is a whole sequence."""
        self.pack_size = int(pack_size)
        self.cp_size = int(cp_size)
        self.algorithm = algorithm
        self.seed = seed
        self.stats = stats
        self.placement = placement
        """The CP placement of every entry (``cp_placement="adaptive"``), or None: TE's layout,
        every entry split over all ``cp_size`` ranks."""
        self.cost_model = cost_model
        """The cost model the placement minimised, or None without a placement."""
        self.a2a_packs = None if a2a_packs is None else np.asarray(a2a_packs, dtype=bool)
        """(P,) bool under ``cp_placement="auto"``: the packs whose attention the step-time model
        runs fastest by all-to-all (the others by their placement's groups); None otherwise."""
        if self.a2a_packs is not None and (placement is None or self.a2a_packs.shape != (len(self.offsets) - 1,)):
            raise ValueError("a2a_packs needs a placement and one flag per pack")
        if len(self.offsets) < 1 or self.offsets[0] != 0 or self.offsets[-1] != len(self.indices):
            raise ValueError("offsets must start at 0 and end at len(indices)")
        if placement is not None and (
            placement.cp_size != self.cp_size
            or placement.pack_size != self.pack_size
            or not np.array_equal(placement.offsets, self.offsets)
        ):
            raise ValueError(
                f"the placement ({placement!r}) does not describe this plan's packs ({len(self)} packs of "
                f"{self.pack_size} tokens, cp_size={self.cp_size})"
            )

    def replace(self, **changes: Any) -> PackPlan:
        """A new plan with ``changes`` (constructor keywords) and this plan's every other field,
        checked as any plan is.

        >>> plan = PackPlan(np.array([0, 1]), np.array([0, 2]), sequence_lengths=np.array([3, 4]),
        ...                 pack_size=8, cp_size=1, algorithm="bfd", seed=None, stats=None)
        >>> plan.replace(indices=np.array([1, 0])).segments(0)
        (array([1, 0]), array([0, 0]), array([4, 3]))
        """
        fields = {name: getattr(self, name) for name in _FIELDS}
        return PackPlan(**{**fields, **changes})

    @property
    def cp_placement(self) -> str:
        """``"auto"`` when the plan chose each pack's attention, ``"adaptive"`` when it carries a
        placement, else ``"te"``."""
        if self.placement is None:
            return "te"
        return "adaptive" if self.a2a_packs is None else "auto"

    def placement_summary(self) -> str | None:
        """One line on the plan's CP placement (None in TE's layout): how many of its entries run
        whole on one CP rank and how many are split over a group of ranks (what the trainers log)."""
        if self.placement is None:
            return None
        whole, entries = int((self.placement.group_size == 1).sum()), len(self.placement.lengths)
        line = (
            f"cp placement: {self.cp_placement} ({self.cost_model}): {whole:,} of {entries:,} sequences whole on one "
            f"CP rank, {entries - whole:,} split over a group of ranks"
        )
        if self.a2a_packs is not None:
            line += f"; {int(self.a2a_packs.sum()):,} of {len(self):,} packs attended by all-to-all"
        return line

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"pack {i} out of range for a plan of {n} packs")
        i %= n
        return self.indices[self.offsets[i] : self.offsets[i + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self)):
            yield self.indices[self.offsets[i] : self.offsets[i + 1]]

    def __repr__(self) -> str:
        return (
            f"PackPlan({len(self):,} packs of {self.pack_size:,} tokens, {len(self.indices):,} entries, "
            f"algorithm={self.algorithm!r}, cp_size={self.cp_size}"
            + (
                f", cp_placement={self.cp_placement!r}, cost_model={self.cost_model!r})"
                if self.placement is not None
                else ")"
            )
        )

    def segments(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Pack ``i`` as ``(indices, starts, lengths)``: take tokens
        ``[starts[j], starts[j] + lengths[j])`` of sequence ``indices[j]``."""
        idx = self[i]
        i %= len(self)
        a, b = self.offsets[i], self.offsets[i + 1]
        starts = np.zeros(len(idx), dtype=np.int64) if self.entry_starts is None else self.entry_starts[a:b]
        lengths = self.sequence_lengths[idx] if self.entry_lengths is None else self.entry_lengths[a:b]
        return idx, starts, lengths

    def save(self, path: str | os.PathLike) -> None:
        """Write a compact ``.npz`` (index arrays in the smallest exact dtype + JSON metadata; no pickle)."""
        meta = {
            "format": FORMAT,
            "pack_size": self.pack_size,
            "cp_size": self.cp_size,
            "algorithm": self.algorithm,
            "seed": self.seed,
            "stats": None if self.stats is None else self.stats.to_dict(),
            "cp_placement": self.cp_placement,
            "cost_model": self.cost_model,
        }
        arrays = {
            "indices": _compact(self.indices),
            "offsets": _compact(self.offsets),
            "sequence_lengths": _compact(self.sequence_lengths),
            "meta": np.array(json.dumps(meta)),
        }
        if self.entry_starts is not None:
            arrays["entry_starts"] = _compact(self.entry_starts)
        if self.entry_lengths is not None:
            arrays["entry_lengths"] = _compact(self.entry_lengths)
        if self.placement is not None:
            arrays.update({key: _compact(value) for key, value in self.placement.to_arrays().items()})
        if self.a2a_packs is not None:
            arrays["cp_a2a_packs"] = self.a2a_packs
        with open(path, "wb") as f:  # a file object keeps np.savez from appending ".npz"
            np.savez(f, **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> PackPlan:
        """Read a plan written by ``save``."""
        with np.load(Path(path), allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path} is not a thdpack plan (format {meta.get('format')!r}, expected {FORMAT!r})")
            stats = None
            if meta["stats"] is not None:
                fields = {k: v for k, v in meta["stats"].items() if k in PackingStats.__dataclass_fields__}
                fields["fullness_percentiles"] = {int(k): v for k, v in fields["fullness_percentiles"].items()}
                stats = PackingStats(**fields)
            plan = cls(
                data["indices"],
                data["offsets"],
                sequence_lengths=data["sequence_lengths"],
                pack_size=meta["pack_size"],
                cp_size=meta["cp_size"],
                algorithm=meta["algorithm"],
                seed=meta["seed"],
                stats=stats,
                entry_starts=data.get("entry_starts"),
                entry_lengths=data.get("entry_lengths"),
            )
            if meta.get("cp_placement", "te") in ("adaptive", "auto"):
                plan.placement = CpPlacement.from_arrays(
                    data, offsets=plan.offsets, lengths=plan.entry_lengths_flat(), cp_size=plan.cp_size,
                    pack_size=plan.pack_size,
                )  # fmt: skip
                plan.cost_model = meta["cost_model"]
            if meta.get("cp_placement") == "auto":
                a2a = np.asarray(data["cp_a2a_packs"], dtype=bool)
                if a2a.shape != (len(plan),):
                    raise ValueError(f"{path}: cp_a2a_packs has shape {a2a.shape}, not one flag per pack ({len(plan)})")
                plan.a2a_packs = a2a
            return plan

    def entry_lengths_flat(self) -> np.ndarray:
        """(E,) int64 tokens of every entry, pack by pack."""
        return self.sequence_lengths[self.indices] if self.entry_lengths is None else self.entry_lengths


_FIELDS = tuple(inspect.signature(PackPlan.__init__).parameters)[1:]
"""The constructor's parameters, each an attribute of the plan under its name."""
