"""CpPlacement: where each sequence of a plan's packs runs under context parallelism (numpy only).

Per sequence, a **group** of ranks: ``group_size == 1`` is **whole** on rank ``group_start`` (its
length, no CP padding, no communication); ``group_size == g > 1`` is **split** over ranks
``group_start .. group_start+g-1`` in TE's dual-chunk layout within the group (``g == cp_size``
everywhere is TE's layout). Every rank holds ``pack_size / cp_size`` tokens: after the sequences
come one padding entry per rank for what it leaves unused. docs/design/cp_placement.md has the
rules and a worked example.

Legend: ``S`` sequences (entries) of a pack, ``E`` entries of a plan, ``P`` packs, ``R`` ranks.

>>> pack = PackPlacement.from_groups([6, 2, 3, 1], {(0, 2): [0], (0, 1): [1, 3], (1, 1): [2]},
...                                  cp_size=2, pack_size=16)
>>> pack.group_size_S.tolist(), pack.group_start_S.tolist()
([2, 1, 1, 1], [0, 0, 1, 0])
>>> layout = pack.layout()          # slots: 6 -> 8 (split over 2), whole ones as they are, then the tails
>>> layout.slots_S.tolist(), layout.lengths_S.tolist()
([8, 2, 3, 1, 1, 1], [6, 2, 3, 1, 0, 0])
>>> [layout.rank_indices(2, r).tolist() for r in (0, 1)]   # rank 0: chunks 0, 3 of sequence 0, sequences 1, 3, its tail
[[0, 1, 6, 7, 8, 9, 13, 14], [2, 3, 4, 5, 10, 11, 12, 15]]

Legend: ``S`` sequences (entries) of a pack, ``E`` entries of a plan, ``P`` packs, ``R`` ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from thdpack._settings import check_int
from thdpack.layout.entries import CpLayout, rank_sums
from thdpack.layout.rules import check_cp_size, check_groups, slot_lengths


def _where(pack: int, position: int, sequence_ids: np.ndarray | None, entry: int) -> str:
    named = "" if sequence_ids is None else f" (dataset sequence {int(sequence_ids[entry])})"
    return f"pack {pack}: sequence {position} of the pack{named}"


def check_budgets(tokens_PR: np.ndarray, budget: int, pack_size: int, cp_size: int) -> None:
    """``ValueError`` naming the first pack and rank of ``tokens_PR`` ((P, R) tokens each rank
    holds of each pack) over its ``budget`` (``pack_size / cp_size``)."""
    over = tokens_PR > budget
    if over.any():
        p, r = (int(x) for x in np.unravel_index(int(np.argmax(over)), over.shape))
        raise ValueError(
            f"pack {p}: rank {r} holds {int(tokens_PR[p, r])} tokens, over its budget of {budget} "
            f"(pack_size={pack_size} / cp_size={cp_size}); place fewer sequences whole on rank {r} "
            "or split them over a group"
        )


@dataclass(frozen=True, eq=False)
class CpPlacement:
    """The CP placement of every pack of a plan: per entry (pack by pack, in pack order) its group.

    Build it with a planner (``plan_packs(..., cp_placement="adaptive")``), ``all_split`` (TE's
    layout) or ``PackPlacement.from_groups``; ``validate`` checks it. ``pack(i)`` is one pack's view.
    """

    cp_size: int
    """Context-parallel ranks."""
    pack_size: int
    """Tokens of a pack; every rank's budget is ``pack_size / cp_size``."""
    offsets: np.ndarray
    """(P+1,) int64 pack boundaries in the entry arrays."""
    lengths: np.ndarray
    """(E,) int64 real tokens of every entry."""
    group_size: np.ndarray
    """(E,) int64 ranks of each entry's group (1 = whole)."""
    group_start: np.ndarray
    """(E,) int64 first rank of each entry's group."""

    def __post_init__(self) -> None:
        for name in ("offsets", "lengths", "group_size", "group_start"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.int64))
        object.__setattr__(self, "cp_size", check_cp_size(self.cp_size))
        object.__setattr__(self, "pack_size", check_int("pack_size", self.pack_size, 1))
        if self.pack_size % self.cp_size:
            raise ValueError(f"pack_size={self.pack_size} is not a multiple of cp_size={self.cp_size}")
        n = len(self.lengths)
        if len(self.offsets) < 1 or self.offsets[0] != 0 or self.offsets[-1] != n or (np.diff(self.offsets) < 0).any():
            raise ValueError(f"offsets must rise from 0 to the number of entries ({n})")
        if len(self.group_size) != n or len(self.group_start) != n:
            raise ValueError(
                f"the placement gives groups for {len(self.group_size)} / {len(self.group_start)} entries but has "
                f"{n} lengths; one group per entry"
            )

    @property
    def budget(self) -> int:
        """Tokens every rank holds: ``pack_size / cp_size``."""
        return self.pack_size // self.cp_size

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __repr__(self) -> str:
        split = int((self.group_size > 1).sum())
        return (
            f"CpPlacement({len(self):,} packs, {len(self.lengths):,} entries ({split:,} split), "
            f"cp_size={self.cp_size}, pack_size={self.pack_size:,})"
        )

    @classmethod
    def all_split(cls, offsets: np.ndarray, lengths: np.ndarray, *, cp_size: int, pack_size: int) -> CpPlacement:
        """Transformer Engine's layout: every entry split over all ``cp_size`` ranks."""
        n = len(lengths)
        return cls(
            cp_size=cp_size,
            pack_size=pack_size,
            offsets=offsets,
            lengths=lengths,
            group_size=np.full(n, cp_size, dtype=np.int64),
            group_start=np.zeros(n, dtype=np.int64),
        )

    def pack(self, i: int) -> PackPlacement:
        """Pack ``i``'s placement."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"pack {i} out of range for a placement of {n} packs")
        a, b = self.offsets[i % n], self.offsets[i % n + 1]
        return PackPlacement(
            cp_size=self.cp_size,
            pack_size=self.pack_size,
            lengths_S=self.lengths[a:b],
            group_size_S=self.group_size[a:b],
            group_start_S=self.group_start[a:b],
        )

    def pack_of_entry(self) -> np.ndarray:
        """(E,) int64 the pack of every entry."""
        return np.repeat(np.arange(len(self), dtype=np.int64), np.diff(self.offsets))

    def slots(self) -> np.ndarray:
        """(E,) int64 slot of every entry (``slot_lengths``)."""
        return slot_lengths(self.lengths, self.group_size)

    def rank_tokens(self) -> np.ndarray:
        """(P, R) int64 tokens each rank holds of each pack, tail padding excluded."""
        slots = self.slots()
        return rank_sums(
            self.pack_of_entry(), slots // self.group_size, self.group_start, self.group_size, len(self), self.cp_size
        )

    @property
    def cp_padding_tokens(self) -> int:
        """Padding inside the split entries' slots (whole entries have none)."""
        return int((self.slots() - self.lengths).sum())

    def validate(self, sequence_ids: np.ndarray | None = None) -> None:
        """Raise ``ValueError`` naming the pack, the sequence (its position in the pack, and
        ``sequence_ids[entry]`` when given) and the value for the first fault: a group size that is
        not allowed (does not divide ``cp_size`` or is not a power of 2), a misaligned group, a
        sequence of length < 1, a rank over its budget."""
        pack_E = self.pack_of_entry()

        def where(entry: int) -> str:
            pack = int(pack_E[entry])
            return _where(pack, entry - int(self.offsets[pack]), sequence_ids, entry)

        check_groups(self.group_size, self.group_start, self.cp_size, where)
        bad = self.lengths < 1
        if bad.any():
            e = int(np.argmax(bad))
            raise ValueError(f"{where(e)} has length {int(self.lengths[e])}; every sequence has at least 1 token")
        check_budgets(self.rank_tokens(), self.budget, self.pack_size, self.cp_size)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The group arrays to save beside a plan (lengths and offsets are the plan's)."""
        return {"cp_group_size": self.group_size, "cp_group_start": self.group_start}

    @classmethod
    def from_arrays(
        cls, arrays: Mapping[str, np.ndarray], *, offsets: np.ndarray, lengths: np.ndarray, cp_size: int, pack_size: int
    ) -> CpPlacement:
        """The placement ``to_arrays`` saved, validated."""
        placement = cls(
            cp_size=cp_size,
            pack_size=pack_size,
            offsets=offsets,
            lengths=lengths,
            group_size=arrays["cp_group_size"],
            group_start=arrays["cp_group_start"],
        )
        placement.validate()
        return placement


@dataclass(frozen=True, eq=False)
class PackPlacement:
    """One pack's placement: per sequence in pack order, its group (see the module docstring)."""

    cp_size: int
    pack_size: int
    lengths_S: np.ndarray
    """(S,) int64 real tokens of each sequence."""
    group_size_S: np.ndarray
    """(S,) int64 ranks of each sequence's group (1 = whole)."""
    group_start_S: np.ndarray
    """(S,) int64 first rank of each sequence's group."""

    def __post_init__(self) -> None:
        for name in ("lengths_S", "group_size_S", "group_start_S"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.int64).reshape(-1))

    @classmethod
    def from_groups(
        cls,
        lengths_S: Sequence[int] | np.ndarray,
        groups: Mapping[tuple[int, int], Sequence[int]],
        *,
        cp_size: int,
        pack_size: int,
    ) -> PackPlacement:
        """The placement from ``{(group_start, group_size): [sequence, ...]}`` (whole sequences:
        ``(rank, 1)``), validated. Raises ``ValueError`` for a sequence placed twice or never,
        and for everything ``validate`` rejects.

        >>> PackPlacement.from_groups([4, 2], {(0, 1): [0, 1], (1, 1): [1]}, cp_size=2, pack_size=8)
        Traceback (most recent call last):
        ...
        ValueError: sequence 1 of the pack is placed twice: on ranks 0..0 and on ranks 1..1; place every sequence once
        """
        lengths_S = np.asarray(lengths_S, dtype=np.int64).reshape(-1)
        size_S = np.zeros(len(lengths_S), dtype=np.int64)
        start_S = np.zeros(len(lengths_S), dtype=np.int64)
        for (start, size), members in groups.items():
            for s in members:
                if not 0 <= s < len(lengths_S):
                    raise ValueError(
                        f"group (start {start}, size {size}) lists sequence {s}, but the pack holds "
                        f"{len(lengths_S)} sequences (0..{len(lengths_S) - 1})"
                    )
                if size_S[s]:
                    first = f"{start_S[s]}..{start_S[s] + size_S[s] - 1}"
                    raise ValueError(
                        f"sequence {s} of the pack is placed twice: on ranks {first} and on ranks "
                        f"{start}..{start + size - 1}; place every sequence once"
                    )
                size_S[s], start_S[s] = size, start
        never = np.flatnonzero(size_S == 0)
        if len(never):
            raise ValueError(
                f"sequence {int(never[0])} of the pack is placed never ({len(never)} unplaced in all); every "
                "sequence needs a group (whole: (rank, 1))"
            )
        pack = cls(
            cp_size=cp_size, pack_size=pack_size, lengths_S=lengths_S, group_size_S=size_S, group_start_S=start_S
        )
        pack.validate()
        return pack

    def as_plan(self) -> CpPlacement:
        """This pack as a one-pack ``CpPlacement``."""
        return CpPlacement(
            cp_size=self.cp_size,
            pack_size=self.pack_size,
            offsets=np.array([0, len(self.lengths_S)]),
            lengths=self.lengths_S,
            group_size=self.group_size_S,
            group_start=self.group_start_S,
        )

    def validate(self) -> None:
        """``CpPlacement.validate`` for this pack (it is named pack 0)."""
        self.as_plan().validate()

    @property
    def slots_S(self) -> np.ndarray:
        """(S,) int64 slot of each sequence (``slot_lengths``)."""
        return slot_lengths(self.lengths_S, self.group_size_S)

    def rank_tokens(self) -> np.ndarray:
        """(R,) int64 tokens of sequences each rank holds (tail padding excluded)."""
        return self.as_plan().rank_tokens()[0]

    def layout(self) -> CpLayout:
        """The pack's global layout: its sequences in their slots, then one padding entry per
        rank (real length 0, slot = the rank's unused budget, whole on that rank); slots sum to
        ``pack_size``."""
        tail_R = self.pack_size // self.cp_size - self.rank_tokens()
        if (tail_R < 0).any():
            self.validate()  # names the rank over its budget
        ranks_R = np.arange(self.cp_size, dtype=np.int64)
        return CpLayout(
            lengths_S=np.concatenate((self.lengths_S, np.zeros(self.cp_size, dtype=np.int64))),
            slots_S=np.concatenate((self.slots_S, tail_R)),
            group_size_S=np.concatenate((self.group_size_S, np.ones(self.cp_size, dtype=np.int64))),
            group_start_S=np.concatenate((self.group_start_S, ranks_R)),
        )
