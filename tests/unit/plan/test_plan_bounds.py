"""The L2 lower bound is valid (never above the optimum) and at least the classic bounds."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from plan_reference import best_fit_decreasing, optimum

from thdpack.plan import l2_lower_bound


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
