"""materialize: chunked ranking equals one-shot ranking; bad inputs are caught."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import thdpack.plan.assignment as assignment
from thdpack.plan import plan_histogram


@given(st.lists(st.integers(1, 30), min_size=1, max_size=300), st.integers(1, 64), st.none() | st.integers(0, 99))
def test_chunked_equals_one_shot(sizes, chunk, seed):
    sizes = np.asarray(sizes)
    hp = plan_histogram(np.bincount(sizes, minlength=31), 30)
    rng = None if seed is None else np.random.default_rng(seed)
    one_shot = assignment.materialize(hp, sizes, rng=rng)
    saved = assignment.CHUNK
    assignment.CHUNK = chunk
    try:
        rng = None if seed is None else np.random.default_rng(seed)
        chunked = assignment.materialize(hp, sizes, rng=rng)
    finally:
        assignment.CHUNK = saved
    assert np.array_equal(one_shot[0], chunked[0]) and np.array_equal(one_shot[1], chunked[1])
    indices, offsets = one_shot
    assert sorted(indices.tolist()) == list(range(len(sizes)))
    assert (np.add.reduceat(sizes[indices], offsets[:-1]) <= 30).all()


def test_rejects_sizes_that_do_not_match_the_plan():
    hp = plan_histogram(np.bincount([3, 3, 4], minlength=11), 10)
    with pytest.raises(ValueError, match="the plan holds 3 items but 2 were given"):
        assignment.materialize(hp, np.array([3, 3]))
    with pytest.raises(ValueError, match="some size has more items than slots"):
        assignment.materialize(hp, np.array([3, 3, 3]))
