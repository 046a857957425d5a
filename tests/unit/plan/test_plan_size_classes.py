"""The bfd / ffd engine works on distinct sizes: at every capacity, ``plan_packs`` packs as the
item-by-item references of plan_reference.py do, and its memory follows the sequences whatever
pack_size is."""

from __future__ import annotations

import itertools
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_reference import best_fit_decreasing, first_fit_decreasing

import thdpack.plan.assignment as assignment
from thdpack.plan import plan_histogram, plan_packs, plan_size_classes
from thdpack.plan.assignment import size_ranks


@st.composite
def problems(draw):
    """Small capacities, capacities around the 2**16 switch of materialize's keys, large ones;
    lengths drawn from a few repeated values (size classes with many items: small ones, many to a
    pack; half a pack and a whole one, where the fit's rules change) and free values."""
    cp_size = draw(st.sampled_from([1, 2]))
    multiple = 2 * cp_size if cp_size > 1 else 1
    capacity = draw(st.integers(1, 64) | st.integers(2**16 - 2, 2**16 + 2) | st.integers(2**16, 2**20))
    pack_size = capacity * multiple
    halves = st.sampled_from([max(1, pack_size // 2), pack_size // 2 + 1, pack_size])
    small = st.integers(1, max(1, pack_size // 8))  # many copies to a pack
    pool = draw(st.lists(st.integers(1, pack_size) | halves | small, min_size=1, max_size=6))
    lengths = draw(st.lists(st.sampled_from(pool) | st.integers(1, pack_size), min_size=1, max_size=120))
    return lengths, pack_size, cp_size


def _plan(problem, algorithm, seed, *, rank_keys):
    lengths, pack_size, cp_size = problem
    saved = assignment.SIZE_KEYS_BELOW
    assignment.SIZE_KEYS_BELOW = 0 if rank_keys else saved  # rank keys at every capacity
    try:
        return plan_packs(lengths, pack_size, algorithm=algorithm, cp_size=cp_size, seed=seed, improve=False)
    finally:
        assignment.SIZE_KEYS_BELOW = saved


@settings(max_examples=400)  # a fit that errs only where a size class spans packs needs the draws
@given(problems(), st.sampled_from(["bfd", "ffd"]), st.none() | st.integers(0, 1000))
def test_plan_packs_packs_as_item_level_ffd_and_bfd(problem, algorithm, seed):
    """Every sequence in exactly one pack that holds it; FFD's packs are item-level FFD's, pack by
    pack in order; BFD's have item-level BFD's loads (ties between equally full packs may pick
    other packs, but the rooms evolve alike). Ranking items by their size's rank instead of by
    their size gives the very same plan."""
    lengths, pack_size, cp_size = problem
    plan = _plan(problem, algorithm, seed, rank_keys=False)
    ranked = _plan(problem, algorithm, seed, rank_keys=True)
    assert plan.indices.tolist() == ranked.indices.tolist() and plan.offsets.tolist() == ranked.offsets.tolist()
    multiple = 2 * cp_size if cp_size > 1 else 1
    units, capacity = [-(-n // multiple) for n in lengths], pack_size // multiple
    got = [[units[i] for i in plan[p]] for p in range(len(plan))]
    assert sorted(plan.indices.tolist()) == list(range(len(lengths)))
    assert max(sum(pack) for pack in got) <= capacity
    if algorithm == "ffd":
        assert got == [[units[i] for i in pack] for pack in first_fit_decreasing(units, capacity)]
    else:
        want = best_fit_decreasing(units, capacity)
        assert sorted(sum(pack) for pack in got) == sorted(sum(units[i] for i in pack) for pack in want)


@pytest.mark.parametrize(
    ("high", "pack_size"),
    [(10**7, 10**9), (2**36, 2**40)],
    ids=["1e9", "2^40"],
)
@pytest.mark.parametrize("algorithm", ["bfd", "ffd"])
def test_memory_follows_the_sequences_not_the_pack_size(high, pack_size, algorithm):
    """Many packs of a huge pack_size: the old engine's size histogram alone was pack_size + 1
    int64 (7.45 GiB for 1e9; 8 TiB for 2**40)."""
    n = 5000
    lengths = np.random.default_rng(0).integers(1, high, n)
    assert lengths.sum() > 10 * pack_size  # many packs, not one
    tracemalloc.start()
    try:
        plan = plan_packs(lengths, pack_size, algorithm=algorithm)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 << 20, f"{peak / 2**20:.1f} MiB for {n} sequences"
    assert sorted(plan.indices.tolist()) == list(range(n))
    loads = np.add.reduceat(lengths[plan.indices], plan.offsets[:-1])
    assert loads.max() <= pack_size
    assert len(plan) == plan.stats.lower_bound_packs  # long sequences in a huge pack: optimal


def test_worked_example_at_a_huge_capacity():
    # the plan_histogram worked example (5,5 | 4,3,3 | 1 in packs of 10), scaled by 10**11
    scale = 10**11
    hp = plan_size_classes(np.array([1, 3, 4, 5]) * scale, np.array([1, 2, 1, 2]), capacity=10 * scale)
    small = plan_histogram(np.bincount([5, 5, 4, 3, 3, 1], minlength=11), 10)
    assert sorted(hp.pack_contents(g) for g in range(len(hp.group_node))) == sorted(
        [(size * scale, reps) for size, reps in small.pack_contents(g)] for g in range(len(small.group_node))
    )
    indices, offsets = assignment.materialize(hp, np.array([5, 5, 4, 3, 3, 1]) * scale)
    assert [indices[a:b].tolist() for a, b in itertools.pairwise(offsets)] == [[0, 1], [2, 3, 4], [5]]


@pytest.mark.parametrize(
    ("sizes", "counts", "capacity", "message"),
    [
        ([3, 2], [1, 1], 10, r"sizes must be strictly increasing integers in \[1, capacity=10\], got \[3, 2\]"),
        ([2, 11], [1, 1], 10, r"largest 11"),
        ([0, 2], [1, 1], 10, r"smallest 0"),
        ([2, 3], [1, 0], 10, r"counts must be >= 1 \(list only the sizes that occur\), got 0"),
        ([2, 3], [1], 10, r"sizes and counts must be 1-D of one length, got shapes \(2,\) and \(1,\)"),
        ([2], [1], 0, r"capacity must be >= 1, got 0"),
    ],
)
def test_plan_size_classes_bad_input(sizes, counts, capacity, message):
    with pytest.raises(ValueError, match=message):
        plan_size_classes(np.array(sizes), np.array(counts), capacity)


def test_sizes_outside_the_plan_are_named():
    with pytest.raises(ValueError, match="item 2 has size 9, which no slot of the plan has"):
        size_ranks(np.array([3, 7, 9]), np.array([3, 7]))
    with pytest.raises(ValueError, match="item 1 has size 8, which no slot of the plan has"):
        size_ranks(np.array([10**12, 8]), np.array([3, 10**12]))  # binary search: sizes too large for a table
    hp = plan_histogram(np.bincount([3, 3, 4], minlength=11), 10)
    with pytest.raises(ValueError, match=r"item 0 has size 70000, outside \[1, capacity=10\]"):
        assignment.materialize(hp, np.array([70000, 3, 4]))  # once wrapped to 16 bits, unnoticed
    huge = plan_size_classes(np.array([3, 4]), np.array([2, 1]), 2**20)
    with pytest.raises(ValueError, match="item 1 has size 5, which no slot of the plan has"):
        assignment.materialize(huge, np.array([3, 5, 4]))
