"""thdpack.thd.tokens: where every token sits; one rule for which rows are real."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from thdpack.thd.tokens import TokenPlacement, real_rows


@given(st.lists(st.integers(0, 9), min_size=1, max_size=8), st.data())
def test_real_rows_mark_exactly_each_slots_real_prefix(lengths, data):
    extra = data.draw(st.lists(st.integers(0, 5), min_size=len(lengths), max_size=len(lengths)))
    padded = np.array(lengths) + np.array(extra)
    real = real_rows(padded, np.array(lengths))
    assert real.sum() == sum(lengths) and len(real) == padded.sum()
    starts = np.cumsum(padded) - padded
    for start, n, slot in zip(starts, lengths, padded, strict=True):
        assert real[start : start + n].all() and not real[start + n : start + slot].any()
    placement = TokenPlacement(tuple(padded.tolist()), tuple(lengths))
    assert torch.equal(placement.valid_T, torch.from_numpy(real))
    assert torch.equal(placement.padding_mask_T, torch.from_numpy(~real))


def test_halves_split_every_sequence_in_two():
    placement = TokenPlacement((4, 2), (3, 1))
    assert placement.half_index(False).tolist() == [0, 1, 4] and placement.half_index(True).tolist() == [2, 3, 5]
    assert placement.half(True).valid_counts == (1, 0) and placement.half(False).valid_counts == (2, 1)


def test_bad_counts_are_rejected():
    with pytest.raises(ValueError, match=r"valid_counts \(3, 4\) must be <= counts \(4, 2\)"):
        TokenPlacement((4, 2), (3, 4))
