"""The adaptive CP planner: packs planned for per-sequence placement, and each pack's placement.

Under Transformer Engine's layout every sequence is split over all CP ranks, so short ones become
slivers that cost every rank a kernel tile per ring step. This planner places short sequences
whole (no CP padding, no communication) and chooses a group of ranks per longer one, in two levels:
the long sequences are packed in TE slots and each pack template placed (``thdpack.plan.place``),
then the short ones fill the ranks' remaining room. Every pack is feasible by construction, never
costs a rank more than TE's layout of it (tiles), and the plan never has more packs than ``te``'s;
docs/design/cp_placement.md (section 7) says why.

Legend: ``E`` entries, ``P`` packs, ``R`` ranks, ``K`` templates, ``M`` positions, ``B`` bins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from thdpack.layout.placement import CpPlacement
from thdpack.layout.rules import cp_multiple, group_options, round_up_to_cp
from thdpack.plan.assignment import materialize
from thdpack.plan.bounds import l2_lower_bound_of_sizes
from thdpack.plan.cp_cost import Costing, rank_costs, whole_cost, whole_limit
from thdpack.plan.decreasing_fit import Fit, distinct_sizes
from thdpack.plan.ordered import next_fit, window_best_fit
from thdpack.plan.place import place_rows
from thdpack.plan.size_classes import plan_size_classes

ROW_CHUNK = 4096
"""Packs placed per vectorised batch when packs have no shared templates (sequential / window)."""


@dataclass(frozen=True)
class AdaptivePlan:
    """Packs of entries and every entry's group."""

    ids: np.ndarray
    """(E,) int64 entry index, pack by pack."""
    offsets: np.ndarray
    """(P+1,) int64 pack boundaries in ``ids``."""
    group_size: np.ndarray
    """(E,) int64 ranks of each placed entry's group, aligned with ``ids``."""
    group_start: np.ndarray
    """(E,) int64 first rank of each placed entry's group."""
    repaired_packs: int = 0
    """Packs whose placement was repaired (never worse than TE's layout)."""
    te_packs: bool = False
    """True when TE's packs were used (they were fewer than the two-level plan's)."""


def _templates(units_E: np.ndarray, ids: np.ndarray, group_count: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """(K, M) the units of one pack of every group (packs of a group are consecutive); 0 = none."""
    first_pack = np.cumsum(group_count) - group_count
    start_K, count_K = offsets[first_pack], np.diff(offsets)[first_pack]
    width = int(count_K.max()) if len(count_K) else 0
    pos_KM = start_K[:, None] + np.arange(width)
    valid_KM = np.arange(width) < count_K[:, None]
    return np.where(valid_KM, units_E[ids[np.where(valid_KM, pos_KM, 0)]], 0)


def _positions(offsets: np.ndarray) -> np.ndarray:
    """(E,) position of every entry within its pack."""
    counts = np.diff(offsets)
    return np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(offsets[:-1], counts)


def place_packs(
    lengths_E: np.ndarray,
    ids: np.ndarray,
    offsets: np.ndarray,
    *,
    cp_size: int,
    pack_size: int,
    cost_model: Costing,
    sizes: Sequence[int] | None = None,
    group_count: np.ndarray | None = None,
    fill_density: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Place every entry of packs whose entries reserve their TE slots: ``(group_size,
    group_start)`` aligned with ``ids``. With ``group_count`` (packs of a group consecutive and of
    equal content in TE units), one placement per group is computed on the TE slots and shared by
    its packs; otherwise each pack is placed on its own lengths, ``ROW_CHUNK`` at a time.
    """
    size_O, start_O = group_options(cp_size, sizes)
    budget = pack_size // cp_size
    unit = cp_multiple(cp_size)
    if group_count is not None:
        # TE slots of the templates' entries only: a template stands for all its group's packs
        reserve_KM = round_up_to_cp(_templates(lengths_E, ids, group_count, offsets), cp_size)
        units_KM = reserve_KM // unit
        option_KM = place_rows(
            reserve_KM, reserve_KM, units_KM > 0, cp_size=cp_size, budget=budget, cost_model=cost_model,
            sizes=sizes, fill_density=fill_density,
        )[0]  # fmt: skip
        # entry e of a pack of template k is item e - offsets[pack] of row k: one flat gather each
        row_P = np.repeat(np.arange(len(group_count)), group_count)
        flat_E = np.repeat(row_P * option_KM.shape[1] - offsets[:-1], np.diff(offsets)) + np.arange(len(ids))
        return size_O[option_KM].reshape(-1)[flat_E], start_O[option_KM].reshape(-1)[flat_E]
    num_packs = len(offsets) - 1
    option_E = np.empty(len(ids), dtype=np.int64)
    position_E = _positions(offsets)
    for first in range(0, num_packs, ROW_CHUNK):
        last = min(first + ROW_CHUNK, num_packs)
        a, b = int(offsets[first]), int(offsets[last])
        counts = np.diff(offsets[first : last + 1])
        row_E = np.repeat(np.arange(last - first), counts)
        lengths_KM = np.zeros((last - first, int(counts.max())), dtype=np.int64)
        lengths_KM[row_E, position_E[a:b]] = lengths_E[ids[a:b]]
        # items costliest first within each pack (LPT); the order is undone below
        order_KM = np.argsort(-lengths_KM, axis=1, kind="stable")
        sorted_KM = np.take_along_axis(lengths_KM, order_KM, axis=1)
        option_KM = place_rows(
            sorted_KM, round_up_to_cp(sorted_KM, cp_size), sorted_KM > 0, cp_size=cp_size, budget=budget,
            cost_model=cost_model, sizes=sizes, fill_density=fill_density,
        )[0]  # fmt: skip
        unsorted_KM = np.empty_like(option_KM)
        np.put_along_axis(unsorted_KM, order_KM, option_KM, axis=1)
        option_E[a:b] = unsorted_KM[row_E, position_E[a:b]]
    return size_O[option_E], start_O[option_E]


def _fill_ranks(
    lengths_W: np.ndarray,
    cost_W: np.ndarray,
    used_QR: np.ndarray,
    budget: int,
    *,
    fit: Fit,
    rng: np.random.Generator | None,
    improve: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pack short entries into rank bins: every rank of the Q given packs (room ``budget - used``)
    and fresh ranks of ``budget``, grouped ``cp_size`` at a time into new packs after the Q, in
    order of their cost (``cost_W`` summed).

    Returns ``(order_W, pack_W, rank_W)``: the entries (indices into ``lengths_W``) in their final
    order (pack, rank, then the engine's order within a bin) and each one's pack and rank.
    """
    num_given, cp_size = used_QR.shape
    # sizes x2 so the markers (odd) never share a size class with an entry (even); a marker leaves
    # room 2 * (budget - used) and is larger than half the capacity: one per bin, placed first
    capacity = 4 * budget + 1
    fresh = 2 * int(lengths_W.sum()) // budget + 2  # best fit never leaves two bins half empty
    markers = np.concatenate((2 * used_QR.reshape(-1) + 2 * budget + 1, np.full(fresh, 2 * budget + 1)))
    sizes = np.concatenate((2 * lengths_W, markers))
    hp = plan_size_classes(*distinct_sizes(sizes), capacity, fit=fit, rng=rng, improve=improve)
    ids, offsets = materialize(hp, sizes, rng=rng)
    num_w = len(lengths_W)
    marker_B = ids[offsets[:-1]] - num_w  # a bin's first item is its marker
    assert (marker_B >= 0).all() and int((ids >= num_w).sum()) == len(marker_B), "every bin has one marker"
    holds_B = np.diff(offsets) - 1
    given_B = marker_B < num_given * cp_size
    used_fresh = np.flatnonzero(~given_B & (holds_B > 0))
    # a pack waits for its busiest rank: fresh ranks of similar cost share packs
    bin_of_item = np.repeat(np.arange(len(marker_B)), np.diff(offsets))
    real = ids < num_w
    cost_B = np.bincount(bin_of_item[real], weights=cost_W[ids[real]], minlength=len(marker_B))
    used_fresh = used_fresh[np.argsort(cost_B[used_fresh], kind="stable")]
    pack_B = np.full(len(marker_B), -1, dtype=np.int64)
    rank_B = np.full(len(marker_B), -1, dtype=np.int64)
    pack_B[given_B], rank_B[given_B] = np.divmod(marker_B[given_B], cp_size)
    nth = np.arange(len(used_fresh))
    pack_B[used_fresh], rank_B[used_fresh] = num_given + nth // cp_size, nth % cp_size
    keep = np.flatnonzero((pack_B >= 0) & (holds_B > 0))
    keep = keep[np.lexsort((rank_B[keep], pack_B[keep]))]
    # entries of the kept bins, markers left out, bins in (pack, rank) order
    starts, counts = offsets[keep] + 1, holds_B[keep]
    pos = np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
    return ids[pos], np.repeat(pack_B[keep], counts), np.repeat(rank_B[keep], counts)


def _concat_packs(pack_A: np.ndarray, pack_B: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Merge two entry lists, each grouped by pack in ascending order, pack by pack with A's entries
    first: ``(positions, offsets)``, where every entry of A and then of B goes in the merged list,
    and the merged pack boundaries."""
    count_A = np.bincount(pack_A, minlength=num_packs)
    count_B = np.bincount(pack_B, minlength=num_packs)
    offsets = np.concatenate(([0], np.cumsum(count_A + count_B)))
    pos_A = offsets[pack_A] + _positions(np.concatenate(([0], np.cumsum(count_A))))
    pos_B = offsets[pack_B] + count_A[pack_B] + _positions(np.concatenate(([0], np.cumsum(count_B))))
    return np.concatenate((pos_A, pos_B)), offsets


def plan_adaptive(
    lengths_E: np.ndarray,
    pack_size: int,
    cp_size: int,
    *,
    fit: Fit,
    rng: np.random.Generator | None,
    improve: bool = True,
    cost_model: Costing,
    sizes: Sequence[int] | None = None,
) -> AdaptivePlan:
    """The two-level plan (docs/design/cp_placement.md, section 7) for entries of the given lengths
    (each in ``[1, pack_size]``); ``pack_size`` a multiple of ``2*cp_size``, ``cp_size >= 2``."""
    budget = pack_size // cp_size
    unit = cp_multiple(cp_size)
    short = lengths_E <= _short_limit(cp_size, pack_size, cost_model)
    long_ids = np.flatnonzero(~short)
    short_ids = np.flatnonzero(short)

    # level 1: long entries in TE's slots, one placement per template
    long_units = round_up_to_cp(lengths_E[long_ids], cp_size) // unit
    if len(long_ids):
        hp = plan_size_classes(*distinct_sizes(long_units), pack_size // unit, fit=fit, rng=rng, improve=improve)
        ids1, offsets1 = materialize(hp, long_units, rng=rng)
        short_tokens = int(lengths_E[short_ids].sum())
        free = hp.num_packs * pack_size - int(long_units.sum()) * unit
        # the short entries fill the long packs' free room first (best fit): their cost per token,
        # scaled by how much of that room they can fill
        density = float(whole_cost(lengths_E[short_ids], cost_model).sum()) / max(short_tokens, 1)
        fill_density = density * min(1.0, short_tokens / free) if free > 0 else 0.0
        size1, start1 = place_packs(
            long_units * unit, ids1, offsets1, cp_size=cp_size, pack_size=pack_size, cost_model=cost_model,
            sizes=sizes, group_count=hp.group_count, fill_density=fill_density,
        )  # fmt: skip
        ids1 = long_ids[ids1]
        # the room each rank really has: the templates counted TE slots, a sequence takes less
        used_QR = CpPlacement(cp_size=cp_size, pack_size=pack_size, offsets=offsets1, lengths=lengths_E[ids1],
                              group_size=size1, group_start=start1).rank_tokens()  # fmt: skip
    else:
        fill_density = 0.0
        ids1, offsets1 = np.zeros(0, np.int64), np.zeros(1, np.int64)
        size1 = start1 = np.zeros(0, np.int64)
        used_QR = np.zeros((0, cp_size), np.int64)
    num_long = len(offsets1) - 1

    # level 2: short entries whole, into the long packs' free room and fresh ranks
    short_lengths = lengths_E[short_ids]
    order_W, pack_W, rank_W = _fill_ranks(
        short_lengths, whole_cost(short_lengths, cost_model), used_QR, budget, fit=fit, rng=rng, improve=improve
    )
    num_packs = max(num_long, int(pack_W.max()) + 1 if len(pack_W) else 0)
    pack1 = np.repeat(np.arange(num_long), np.diff(offsets1))
    pos, offsets = _concat_packs(pack1, pack_W, num_packs)
    ids = np.empty(len(lengths_E), dtype=np.int64)
    group_size = np.ones(len(lengths_E), dtype=np.int64)
    group_start = np.empty(len(lengths_E), dtype=np.int64)
    ids[pos] = np.concatenate((ids1, short_ids[order_W]))
    group_size[pos[: len(ids1)]] = size1
    group_start[pos] = np.concatenate((start1, rank_W))
    plan = AdaptivePlan(ids=ids, offsets=offsets, group_size=group_size, group_start=group_start)
    if not _bounded_by_slots(cost_model):  # placed on TE slots, not the real lengths: check every long pack
        plan = _repair(plan, lengths_E, pack_size, cp_size, cost_model, packs=num_long)
    return _no_more_than_te(plan, lengths_E, pack_size, cp_size, cost_model, sizes, fit=fit, rng=rng, improve=improve)


def _repair(
    plan: AdaptivePlan, lengths_E: np.ndarray, pack_size: int, cp_size: int, cost_model: Costing, *, packs: int
) -> AdaptivePlan:
    """The first ``packs`` packs (whose entries all reserve their TE slots) get TE's layout where
    their busiest rank costs more than under it."""
    end = int(plan.offsets[packs])
    lengths = lengths_E[plan.ids[:end]]
    placed = CpPlacement(cp_size=cp_size, pack_size=pack_size, offsets=plan.offsets[: packs + 1], lengths=lengths,
                         group_size=plan.group_size[:end], group_start=plan.group_start[:end])  # fmt: skip
    te = CpPlacement.all_split(placed.offsets, lengths, cp_size=cp_size, pack_size=pack_size)
    worse_P = rank_costs(placed, cost_model).max(axis=1) > rank_costs(te, cost_model).max(axis=1)
    if not worse_P.any():
        return plan
    to_te = np.zeros(len(plan.ids), dtype=bool)
    to_te[:end] = worse_P[placed.pack_of_entry()]
    return AdaptivePlan(
        ids=plan.ids,
        offsets=plan.offsets,
        group_size=np.where(to_te, cp_size, plan.group_size),
        group_start=np.where(to_te, 0, plan.group_start),
        repaired_packs=int(worse_P.sum()),
        te_packs=plan.te_packs,
    )


def _bounded_by_slots(cost_model: Costing) -> bool:
    """True when a placement computed on TE slots bounds the real lengths' costs from above (tiles:
    a longer sequence never runs fewer tiles); pairs and the time model are checked on the real
    lengths after placement."""
    return isinstance(cost_model, str) and cost_model == "tiles"


def _short_limit(cp_size: int, pack_size: int, cost_model: Costing) -> int:
    """Entries this short are *short*: placed whole, without CP padding (at most ``whole_limit``
    tokens and a rank's budget)."""
    return min(whole_limit(cp_size, cost_model), pack_size // cp_size)


def _no_more_than_te(
    plan: AdaptivePlan,
    lengths_E: np.ndarray,
    pack_size: int,
    cp_size: int,
    cost_model: Costing,
    sizes: Sequence[int] | None,
    *,
    fit: Fit,
    rng: np.random.Generator | None,
    improve: bool = True,
) -> AdaptivePlan:
    """``plan``, or TE's packs placed by ``place_packs`` when those are fewer."""
    unit = cp_multiple(cp_size)
    units = round_up_to_cp(lengths_E, cp_size) // unit
    num_packs = len(plan.offsets) - 1
    distinct = distinct_sizes(units)
    if num_packs <= l2_lower_bound_of_sizes(*distinct, pack_size // unit):
        return plan
    hp = plan_size_classes(*distinct, pack_size // unit, fit=fit, rng=rng, improve=improve)
    if hp.num_packs >= num_packs:
        return plan
    ids, offsets = materialize(hp, units, rng=rng)
    group_size, group_start = place_packs(
        units * unit, ids, offsets, cp_size=cp_size, pack_size=pack_size, cost_model=cost_model, sizes=sizes,
        group_count=hp.group_count,
    )  # fmt: skip
    te_plan = AdaptivePlan(ids=ids, offsets=offsets, group_size=group_size, group_start=group_start, te_packs=True)
    if _bounded_by_slots(cost_model):
        return te_plan
    # pairs count real tokens, which the TE slots overestimate: check per pack (the time model too)
    return _repair(te_plan, lengths_E, pack_size, cp_size, cost_model, packs=len(offsets) - 1)


def plan_entries(
    lengths_E: np.ndarray,
    pack_size: int,
    cp_size: int,
    *,
    algorithm: str,
    window: int,
    rng: np.random.Generator | None,
    cost_model: Costing,
    sizes: Sequence[int] | None = None,
    improve: bool = True,
) -> tuple[np.ndarray, np.ndarray, CpPlacement]:
    """``plan_packs(..., cp_placement="adaptive")``'s packs: ``(ids, offsets, placement)`` for
    entries of the given lengths, ``ids`` indexing them pack by pack."""
    if algorithm in ("bfd", "ffd"):
        plan = plan_adaptive(
            lengths_E, pack_size, cp_size, fit=algorithm, rng=rng, cost_model=cost_model, sizes=sizes, improve=improve
        )
        ids, offsets, group_size, group_start = plan.ids, plan.offsets, plan.group_size, plan.group_start
    else:
        unit = cp_multiple(cp_size)
        units = round_up_to_cp(lengths_E, cp_size) // unit
        capacity = pack_size // unit
        if algorithm == "sequential":
            ids, offsets = np.arange(len(units), dtype=np.int64), next_fit(units, capacity)
        else:
            ids, offsets = window_best_fit(units, capacity, window)
        group_size, group_start = place_packs(
            lengths_E, ids, offsets, cp_size=cp_size, pack_size=pack_size, cost_model=cost_model, sizes=sizes
        )
    placement = CpPlacement(cp_size=cp_size, pack_size=pack_size, offsets=offsets, lengths=lengths_E[ids],
                            group_size=group_size, group_start=group_start)  # fmt: skip
    return ids, offsets, placement
