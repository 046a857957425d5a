"""Grouped (histogram) BFD / FFD equal item-by-item BFD / FFD (the fit alone, improve=False)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from plan_reference import best_fit_decreasing, first_fit_decreasing

from thdpack.plan import plan_histogram


def _expanded(hp) -> list[list[int]]:
    packs = []
    for g in range(len(hp.group_node)):
        content = [size for size, reps in hp.pack_contents(g) for _ in range(reps)]
        packs += [content] * int(hp.group_count[g])
    return packs


instances = st.integers(1, 40).flatmap(
    lambda cap: st.tuples(st.just(cap), st.lists(st.integers(1, cap), min_size=1, max_size=80))
)


@given(instances)
def test_ffd_equals_item_level_ffd(instance):
    capacity, sizes = instance
    hp = plan_histogram(np.bincount(sizes, minlength=capacity + 1), capacity, fit="ffd", improve=False)
    want = [sorted(sizes[i] for i in pack) for pack in first_fit_decreasing(sizes, capacity)]
    assert [sorted(p) for p in _expanded(hp)] == want


@given(instances, st.none() | st.integers(0, 2**31))
def test_bfd_equals_item_level_bfd(instance, seed):
    # Ties between equally full packs may pick other packs, but the rooms evolve identically.
    capacity, sizes = instance
    rng = None if seed is None else np.random.default_rng(seed)
    hp = plan_histogram(np.bincount(sizes, minlength=capacity + 1), capacity, fit="bfd", rng=rng, improve=False)
    got = _expanded(hp)
    want = [[sizes[i] for i in pack] for pack in best_fit_decreasing(sizes, capacity)]
    assert len(got) == hp.num_packs == len(want)
    assert sorted(sum(p) for p in got) == sorted(sum(p) for p in want)
    assert sorted(s for p in got for s in p) == sorted(sizes)


def test_worked_example():
    # sizes 5,5 share a pack; 4 takes the 3s (best fit: room 6 beats a new pack); 1 opens a pack
    hp = plan_histogram(np.bincount([5, 5, 4, 3, 3, 1], minlength=11), 10)
    contents = sorted(hp.pack_contents(g) for g in range(len(hp.group_node)))
    assert contents == [[(1, 1)], [(4, 1), (3, 2)], [(5, 2)]]
    assert sorted(hp.node_load()[hp.group_node].tolist()) == [1, 10, 10]


@pytest.mark.parametrize(
    ("counts", "capacity", "fit", "message"),
    [
        (np.zeros(5, dtype=int), 5, "bfd", r"counts must have shape \(6,\)"),
        (np.array([1, 0, 0]), 2, "bfd", r"counts\[0\] must be 0"),
        (np.array([0, 1, 0]), 2, "nf", "unknown fit 'nf'; valid: bfd, ffd"),
    ],
)
def test_bad_input(counts, capacity, fit, message):
    with pytest.raises(ValueError, match=message):
        plan_histogram(counts, capacity, fit=fit)
