"""CpPlacement: where each sequence of a pack runs under context parallelism (numpy only).

Transformer Engine's THD layout splits every sequence over all ``cp_size`` ranks. A placement
says, per sequence, which **group** of ranks it runs on: ``group_size`` ranks starting at rank
``group_start``.

- ``group_size == 1``: the sequence is **whole** on rank ``group_start``: it takes exactly its
  length (no CP padding) and runs through the local varlen kernel, communicating nothing;
- ``group_size == g > 1``: it is **split** over ranks ``group_start .. group_start+g-1`` in TE's
  dual-chunk layout within the group: its slot is its length rounded up to a multiple of ``2g``
  (the CP padding after its real tokens), cut into ``2g`` chunks, and group rank ``j`` keeps chunks
  ``j`` and ``2g-1-j``. ``g == cp_size`` everywhere is TE's layout.

Allowed group sizes: 1, ``cp_size``, and the powers of 2 dividing ``cp_size`` (``group_sizes``);
a group is aligned: ``group_start % group_size == 0`` (for cp 8: sizes 1, 2, 4, 8; for cp 6:
1, 2, 6; for cp 3: 1, 3). Every rank has a budget of ``pack_size / cp_size`` tokens; what a rank
does not use is its **tail padding**.

The pack's global token order (what the packer writes, ``CpLayout``): the sequences in pack
order, each in its slot, then one padding entry per rank (real length 0, slot = that rank's tail
padding, possibly 0, placed whole on the rank), ranks in order. Rank ``r``'s local tokens
(``CpLayout.rank_indices``): first the split groups that contain ``r``, largest group first (for a
given size one aligned group contains ``r``), and in each group its sequences in pack order, each
contributing chunk ``r - group_start`` then chunk ``2g-1-(r - group_start)``; then the entries
whole on ``r`` in pack order, its padding entry last. Every rank holds exactly
``pack_size / cp_size`` tokens. docs/design/cp_placement.md has the worked example.

>>> pack = PackPlacement.from_groups([6, 2, 3, 1], {(0, 2): [0], (0, 1): [1, 3], (1, 1): [2]},
...                                  cp_size=2, pack_size=16)
>>> pack.group_size_S.tolist(), pack.group_start_S.tolist()
([2, 1, 1, 1], [0, 0, 1, 0])
>>> layout = pack.layout()          # slots: 6 -> 8 (split over 2), whole ones as they are, then the tails
>>> layout.slots_S.tolist(), layout.lengths_S.tolist()
([8, 2, 3, 1, 1, 1], [6, 2, 3, 1, 0, 0])
>>> [layout.rank_indices(2, r).tolist() for r in (0, 1)]   # rank 0: chunks 0, 3 of sequence 0, sequences 1, 3, its tail
[[0, 1, 6, 7, 8, 9, 13, 14], [2, 3, 4, 5, 10, 11, 12, 15]]

Legend: ``S`` sequences (entries) of a pack, ``E`` entries of a plan, ``P`` packs, ``R`` ranks,
``O`` groups (options).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from thdpack.plan.cp_cost import CostModel, causal_tiles, split_cost, split_tiles, whole_cost


def group_sizes(cp_size: int) -> tuple[int, ...]:
    """Allowed group sizes for ``cp_size`` ranks, ascending: 1, the powers of 2 dividing
    ``cp_size``, and ``cp_size``.

    >>> group_sizes(8), group_sizes(6), group_sizes(3), group_sizes(1)
    ((1, 2, 4, 8), (1, 2, 6), (1, 3), (1,))
    """
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    sizes = {1, cp_size}
    g = 2
    while g < cp_size and cp_size % g == 0:
        sizes.add(g)
        g *= 2
    return tuple(sorted(sizes))


def group_options(cp_size: int, sizes: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(size_O, start_O)``: every aligned group of the given sizes (default: all allowed), the
    largest groups first, then by start rank.

    >>> [a.tolist() for a in group_options(4)]
    [[4, 2, 2, 1, 1, 1, 1], [0, 0, 2, 0, 1, 2, 3]]
    """
    allowed = group_sizes(cp_size)
    sizes = allowed if sizes is None else tuple(sizes)
    bad = [g for g in sizes if g not in allowed]
    if bad:
        raise ValueError(f"group size {bad[0]} is not allowed for cp_size={cp_size}; valid: {allowed}")
    size_O = np.concatenate([np.full(cp_size // g, g) for g in sorted(set(sizes), reverse=True)]).astype(np.int64)
    start_O = np.concatenate([np.arange(0, cp_size, g) for g in sorted(set(sizes), reverse=True)]).astype(np.int64)
    return size_O, start_O


def slot_lengths(lengths_S: np.ndarray, group_size_S: np.ndarray) -> np.ndarray:
    """(S,) int64 slot of each sequence: its length when whole, rounded up to a multiple of
    ``2 * group_size`` when split.

    >>> slot_lengths(np.array([5, 5, 5]), np.array([1, 2, 4])).tolist()
    [5, 8, 8]
    """
    lengths_S = np.asarray(lengths_S, dtype=np.int64)
    group_size_S = np.asarray(group_size_S, dtype=np.int64)
    step_S = np.where(group_size_S > 1, 2 * group_size_S, 1)
    return -(-lengths_S // step_S) * step_S


class CpLayout(NamedTuple):
    """The global token layout of one pack (or of several packs of a batch, concatenated):
    per entry its real length, slot, and group, tail-padding entries included."""

    lengths_S: np.ndarray
    """(S,) int64 real tokens (0 for a padding entry)."""
    slots_S: np.ndarray
    """(S,) int64 tokens each entry occupies (the THD batch's ``cu_seqlens_padded`` differences)."""
    group_size_S: np.ndarray
    """(S,) int64 ranks of each entry's group (1 = whole)."""
    group_start_S: np.ndarray
    """(S,) int64 first rank of each entry's group."""

    def rank_indices(self, cp_size: int, rank: int) -> np.ndarray:
        """(T_local,) global token indices rank ``rank`` holds, in its local order (the module
        docstring's); ``placement_indices`` on this layout."""
        return placement_indices(self.slots_S, self.group_size_S, self.group_start_S, cp_size, rank)

    @classmethod
    def concat(cls, layouts: Sequence[CpLayout]) -> CpLayout:
        """The layout of packs stored one after another (a batch of several packs): a rank's
        split groups gather the sequences of every pack, in batch order, then its whole entries."""
        return cls(*(np.concatenate([getattr(x, f) for x in layouts]) for f in cls._fields))

    def check(
        self,
        cp_size: int,
        where: Callable[[int], str] = lambda s: f"sequence {s}",
        pack_S: np.ndarray | None = None,
    ) -> None:
        """``ValueError`` naming the first faulty entry (``where(s)``) and its value: a group size not
        allowed for ``cp_size`` (``group_sizes``), a misaligned group, a split entry whose slot is
        not a multiple of ``2 * group_size`` (TE's rule within the group; a whole entry's slot is
        free), or a rank over its share: every rank must hold ``sum(slots) / cp_size`` tokens of
        the layout, or with ``pack_S`` ((S,) the pack of each entry, packs in order) of every pack
        (its budget), so that the shards are equal. Real lengths within the slots are the THD
        record's check.

        >>> CpLayout(np.array([5, 2]), np.array([6, 2]), np.array([2, 1]), np.array([0, 1])).check(2)
        Traceback (most recent call last):
        ...
        ValueError: sequence 0 is split over 2 ranks but has a slot of 6 tokens, not a multiple of 2*2=4; ...
        """
        check_groups(self.group_size_S, self.group_start_S, cp_size, where)
        split = self.group_size_S > 1
        bad = split & (self.slots_S % (2 * self.group_size_S) != 0)
        if bad.any():
            s = int(np.argmax(bad))
            g, slot = int(self.group_size_S[s]), int(self.slots_S[s])
            raise ValueError(
                f"{where(s)} is split over {g} ranks but has a slot of {slot} tokens, not a multiple of 2*{g}={2 * g}; "
                f"TE's layout cuts a split sequence into 2*{g} equal chunks: pad it to {-(-slot // (2 * g)) * 2 * g}"
            )
        named = pack_S is not None
        pack_S = np.zeros(len(self.slots_S), dtype=np.int64) if pack_S is None else np.asarray(pack_S, dtype=np.int64)
        num_packs = int(pack_S[-1]) + 1 if len(pack_S) else 0
        share_S = self.slots_S // self.group_size_S
        tokens_PR = rank_sums(pack_S, share_S, self.group_start_S, self.group_size_S, num_packs, cp_size)
        size_P = np.bincount(pack_S, weights=self.slots_S, minlength=num_packs).round().astype(np.int64)
        over = tokens_PR * cp_size > size_P[:, None]
        if over.any():
            p, r = (int(x) for x in np.unravel_index(int(np.argmax(over)), over.shape))
            what = f"pack {p}: rank {r}" if named else f"rank {r}"
            raise ValueError(
                f"{what} holds {int(tokens_PR[p, r])} tokens, over its budget of {size_P[p] / cp_size:g} (the pack's "
                f"{int(size_P[p])} tokens / cp_size={cp_size}); every rank of a pack holds an equal share (its "
                "padding entry fills what its sequences leave: PackPlacement.layout)"
            )


def rank_groups(group_size_S: np.ndarray, group_start_S: np.ndarray, rank: int) -> list[tuple[int, int, np.ndarray]]:
    """``[(group_start, group_size, entries)]``: the groups holding entries of ``rank``, in its
    local order (split groups largest first, then its whole entries as ``(rank, 1, ...)``), each
    with its entries in storage order; groups without an entry of ``rank`` are left out.

    >>> [(g0, g, e.tolist()) for g0, g, e in rank_groups(np.array([2, 1, 4, 1]), np.array([0, 1, 0, 0]), 1)]
    [(0, 4, [2]), (0, 2, [0]), (1, 1, [1])]
    """
    group_size_S = np.asarray(group_size_S, dtype=np.int64)
    mine = _rank_entries(group_size_S, np.asarray(group_start_S, dtype=np.int64), rank)
    sizes = group_size_S[mine]
    out, begin = [], 0
    for end in [*(np.flatnonzero(sizes[1:] != sizes[:-1]) + 1).tolist(), len(mine)] if len(mine) else []:
        g = int(sizes[begin])  # one aligned group of each size contains the rank
        out.append((rank - rank % g, g, mine[begin:end]))
        begin = end
    return out


def _rank_entries(group_size_S: np.ndarray, group_start_S: np.ndarray, rank: int) -> np.ndarray:
    """(M,) int64 the entries whose group contains ``rank``: largest group first, then storage order."""
    mine = np.flatnonzero((group_start_S <= rank) & (rank < group_start_S + group_size_S))
    return mine[np.argsort(-group_size_S[mine], kind="stable")]


def placement_indices(
    slots_S: np.ndarray, group_size_S: np.ndarray, group_start_S: np.ndarray, cp_size: int, rank: int
) -> np.ndarray:
    """(T_local,) global token indices of ``rank``, in its local order: int32 (as Transformer
    Engine's) while the layout holds fewer than 2**31 tokens, else int64.

    Entries are stored back to back in their slots (entry ``s`` at ``sum(slots_S[:s])``). The
    rank's split groups come first, largest first, each with its entries in order, an entry giving
    chunk ``j = rank - start`` then chunk ``2g-1-j`` of its slot (``chunk = slot / 2g``); then its
    whole entries in order (``rank_groups``). With every entry on ``g == cp_size`` this is exactly
    ``thdpack.cp.partition.partition_from_lengths(slots_S, cp_size, rank)``: Transformer Engine's
    ``thd_get_partitioned_indices``.

    >>> placement_indices(np.array([8, 8]), np.array([2, 2]), np.array([0, 0]), 2, 1).tolist()
    [2, 3, 4, 5, 10, 11, 12, 13]
    >>> placement_indices(np.array([4, 3]), np.array([2, 1]), np.array([0, 1]), 2, 1).tolist()
    [1, 2, 4, 5, 6]
    """
    slots_S = np.asarray(slots_S, dtype=np.int64)
    group_size_S = np.asarray(group_size_S, dtype=np.int64)
    group_start_S = np.asarray(group_start_S, dtype=np.int64)
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank must be in [0, {cp_size}), got {rank}")
    starts_S = np.cumsum(slots_S) - slots_S
    mine = _rank_entries(group_size_S, group_start_S, rank)
    g_M = group_size_S[mine]
    split_M = g_M > 1
    chunk_M = np.where(split_M, slots_S[mine] // (2 * g_M), slots_S[mine])
    j_M = rank - group_start_S[mine]
    # two runs per split entry (head chunk, tail chunk), one per whole entry (the empty tail run)
    head_M = starts_S[mine] + np.where(split_M, j_M * chunk_M, 0)
    tail_M = starts_S[mine] + (2 * g_M - 1 - j_M) * chunk_M
    run_start = np.stack((head_M, tail_M), 1).reshape(-1)
    run_len = np.stack((chunk_M, np.where(split_M, chunk_M, 0)), 1).reshape(-1)
    local_start = np.cumsum(run_len) - run_len
    total = int(run_len.sum())
    # the per-token work in the narrowest exact dtype (int32 halves the memory traffic, as TE's kernel)
    dtype = np.int32 if int(slots_S.sum()) < 2**31 else np.int64
    index_T = np.repeat((run_start - local_start).astype(dtype), run_len)
    index_T += np.arange(total, dtype=dtype)
    return index_T


def rank_sums(
    pack_E: np.ndarray, value_E: np.ndarray, start_E: np.ndarray, size_E: np.ndarray, num_packs: int, cp_size: int
) -> np.ndarray:
    """(P, R) int64: ``value_E`` added to every rank of each entry's group (``size_E`` ranks from
    ``start_E``) of its pack: a difference array over ranks (``+value`` at the group's first rank,
    ``-value`` after its last), then a cumulative sum. Values must stay below 2**53 per pack."""
    width = cp_size + 1
    first = np.bincount(pack_E * width + start_E, weights=value_E, minlength=num_packs * width)
    after = np.bincount(pack_E * width + start_E + size_E, weights=value_E, minlength=num_packs * width)
    diff = (first - after).round().astype(np.int64).reshape(num_packs, width)
    return np.cumsum(diff, axis=1)[:, :cp_size]


def _where(pack: int, position: int, sequence_ids: np.ndarray | None, entry: int) -> str:
    named = "" if sequence_ids is None else f" (dataset sequence {int(sequence_ids[entry])})"
    return f"pack {pack}: sequence {position} of the pack{named}"


def check_groups(
    group_size_E: np.ndarray, group_start_E: np.ndarray, cp_size: int, where: Callable[[int], str]
) -> None:
    """``ValueError`` naming the first entry (``where(e)``) whose group size is not allowed for
    ``cp_size`` (``group_sizes``), or whose group is misaligned or reaches past the last rank."""
    allowed = group_sizes(cp_size)
    bad = ~_allowed_table(cp_size).take(group_size_E, mode="clip")
    if bad.any():
        e = int(np.argmax(bad))
        g = int(group_size_E[e])
        reason = "does not divide" if g < 1 or cp_size % g else "is not a power of 2 below"
        raise ValueError(
            f"{where(e)} is placed on a group of {g} ranks, which {reason} cp_size={cp_size}; "
            f"valid group sizes: {', '.join(map(str, allowed))} (1 = whole on one rank)"
        )
    bad = (group_start_E < 0) | (group_start_E % group_size_E != 0) | (group_start_E + group_size_E > cp_size)
    if bad.any():
        e = int(np.argmax(bad))
        g, g0 = int(group_size_E[e]), int(group_start_E[e])
        raise ValueError(
            f"{where(e)} is placed on ranks {g0}..{g0 + g - 1} (a group of {g} starting at rank {g0}); a group "
            f"of {g} must start at a multiple of {g} in [0, {cp_size - g}] (groups are aligned)"
        )


@functools.cache
def _allowed_table(cp_size: int) -> np.ndarray:
    """(cp_size + 2,) bool, True at the allowed group sizes (a lookup: ``np.isin`` costs tens of
    microseconds per batch); sizes below 0 or above ``cp_size`` clip onto False entries."""
    table = np.zeros(cp_size + 2, dtype=bool)
    table[list(group_sizes(cp_size))] = True
    table.flags.writeable = False
    return table


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
        if self.cp_size < 1 or self.pack_size < 1:
            raise ValueError(f"cp_size and pack_size must be >= 1, got {self.cp_size} and {self.pack_size}")
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

    def rank_costs(self, cost_model: CostModel = "tiles") -> np.ndarray:
        """(P, R) int64 attention cost of each rank in each pack (``thdpack.plan.cp_cost``)."""
        pack_E, slots = self.pack_of_entry(), self.slots()
        whole = self.group_size == 1
        if cost_model == "tiles":  # a split sequence costs every rank of its group the same
            value = np.where(whole, causal_tiles(self.lengths), split_tiles(slots, self.group_size))
            return rank_sums(pack_E, value, self.group_start, self.group_size, len(self), self.cp_size)
        one = np.ones(len(self.lengths), dtype=np.int64)
        cost_PR = rank_sums(
            pack_E[whole], whole_cost(self.lengths[whole], cost_model), self.group_start[whole], one[whole],
            len(self), self.cp_size,
        )  # fmt: skip
        for g in np.unique(self.group_size[~whole]).tolist():
            of_g = np.flatnonzero(self.group_size == g)
            cost_EG = split_cost(self.lengths[of_g], slots[of_g], g, cost_model)
            for j in range(g):
                cost_PR += rank_sums(
                    pack_E[of_g], cost_EG[:, j], self.group_start[of_g] + j, one[of_g], len(self), self.cp_size
                )
        return cost_PR

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
