"""The lower bounds are valid (never above the optimum): L2 at least the classic bounds, the best
bound at least L2 and exact on written-out cases."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_reference import best_fit_decreasing, optimum

from thdpack.plan import l2_lower_bound
from thdpack.plan.bounds import _matched_volume, best_lower_bound_of_sizes, l2_lower_bound_of_sizes


def _instances(max_capacity: int, max_items: int):
    return st.integers(2, max_capacity).flatmap(
        lambda cap: st.tuples(st.just(cap), st.lists(st.integers(1, cap), min_size=1, max_size=max_items))
    )


@given(_instances(12, 9))
def test_never_above_the_optimum(instance):
    capacity, sizes = instance
    bound = l2_lower_bound(np.bincount(sizes, minlength=capacity + 1), capacity)
    assert bound <= optimum(sizes, capacity)


@given(_instances(60, 100))
def test_at_least_sum_and_big_item_bounds(instance):
    capacity, sizes = instance
    bound = l2_lower_bound(np.bincount(sizes, minlength=capacity + 1), capacity)
    assert bound >= -(-sum(sizes) // capacity)
    assert bound >= sum(s > capacity / 2 for s in sizes)
    assert bound <= len(best_fit_decreasing(sizes, capacity))


def test_tighter_than_sum_bound():
    # three 6s and two 5s: the sum bound says 3 packs, but no two 6s share and a 5 fits no 6
    assert l2_lower_bound(np.bincount([6, 6, 6, 5, 5], minlength=11), 10) == 4
    # 7, 7 and three 4s that fit neither 7's room of 3: 2 + ceil(12 / 10) = 4 (sum bound: 3)
    assert l2_lower_bound(np.bincount([7, 7, 4, 4, 4], minlength=11), 10) == 4


def _distinct(sizes):
    values, counts = np.unique(sizes, return_counts=True)
    return values, counts


@settings(max_examples=400, deadline=None)
@given(_instances(16, 10))
def test_best_bound_never_above_the_optimum(instance):
    capacity, sizes = instance
    best = best_lower_bound_of_sizes(*_distinct(sizes), capacity)
    assert l2_lower_bound_of_sizes(*_distinct(sizes), capacity) <= best <= optimum(sizes, capacity)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(8, 30).flatmap(
        lambda c: st.tuples(
            st.just(c),
            # many items of two or three sizes: the single-fill and CCM bounds' territory
            st.lists(st.sampled_from([c // 2 + 1, c - c // 3, c // 3 + 1, c // 4 + 1, 2]), min_size=1, max_size=10),
        )
    )
)
def test_best_bound_never_above_the_optimum_on_structured_instances(instance):
    capacity, sizes = instance
    assert best_lower_bound_of_sizes(*_distinct(sizes), capacity) <= optimum(sizes, capacity)


def test_best_bound_written_out():
    # two 7s whose rooms of 5 take one 3 each: the third 3 needs a pack (L2 treats the 3s as fluid)
    assert l2_lower_bound_of_sizes(np.array([3, 7]), np.array([3, 2]), 12) == 2
    assert best_lower_bound_of_sizes(np.array([3, 7]), np.array([3, 2]), 12) == 3 == optimum([3, 3, 3, 7, 7], 12)
    # five 4s in packs of 10: two per pack, so 3 packs; the CCM function with lam = 4 sees it
    # (each 4 counts 2 of 2*floor(10/4) = 4 per pack) where L2 and the sum bound say 2
    assert l2_lower_bound_of_sizes(np.array([4]), np.array([5]), 10) == 2
    assert best_lower_bound_of_sizes(np.array([4]), np.array([5]), 10) == 3 == optimum([4] * 5, 10)


@given(st.lists(st.tuples(st.integers(1, 12), st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=8))
def test_matched_volume_equals_brute_force(rows):
    """One item per room, an item into a room at least its size: the largest placed volume."""
    import itertools

    table = {}
    for value, items, rooms in rows:
        a, b = table.get(value, (0, 0))
        table[value] = (a + items, b + rooms)
    values = np.array(sorted(table))
    items = np.array([table[v][0] for v in values])
    rooms = np.array([table[v][1] for v in values])
    item_list = [int(v) for v, c in zip(values, items, strict=True) for _ in range(c)]
    room_list = [int(v) for v, c in zip(values, rooms, strict=True) for _ in range(c)]
    best = 0
    for k in range(min(len(item_list), len(room_list)) + 1):
        for chosen in itertools.combinations(item_list, k):
            # a chosen set fits iff, sorted, each item fits the k largest rooms in order
            if all(i <= r for i, r in zip(sorted(chosen), sorted(room_list)[len(room_list) - k :], strict=True)):
                best = max(best, sum(chosen))
    assert _matched_volume(values, items, rooms) == best
