"""thdpack.packing.pack_layout: seq_lens_padded, positions, labels, padding mask (the rules: tests/unit/layout)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from thdpack.layout.rules import IGNORE_INDEX, cp_multiple, round_up_to_cp
from thdpack.packing import pack_layout

N = IGNORE_INDEX
lengths_st = st.lists(st.integers(1, 40), min_size=1, max_size=12)


@given(lengths_st, st.sampled_from([1, 2, 4]), st.integers(0, 50))
def test_pack_seq_lens_padded_sums_to_pack_size(lengths, cp_size, spare):
    multiple = cp_multiple(cp_size)
    used = int(round_up_to_cp(np.array(lengths), cp_size).sum())
    pack_size = -(-(used + spare) // multiple) * multiple
    padded = pack_layout.pack_seq_lens_padded(np.array(lengths), pack_size, cp_size)
    assert padded.sum() == pack_size and (padded % multiple == 0).all()
    assert (padded[:-1] == round_up_to_cp(np.array(lengths[:-1]), cp_size)).all()


@given(st.lists(st.integers(0, 20), min_size=1, max_size=10))
def test_position_ids_restart_per_sequence(padded):
    pos = pack_layout.position_ids(np.array(padded))
    starts = np.cumsum(padded) - padded
    assert len(pos) == sum(padded)
    for start, n in zip(starts, padded, strict=True):
        assert pos[start : start + n].tolist() == list(range(n))


@given(lengths_st)
def test_next_token_labels_stay_in_their_sequence(lengths):
    ids = np.arange(1, sum(lengths) + 1)
    labels = pack_layout.next_token_labels(ids, np.array(lengths))
    ends = np.cumsum(lengths) - 1
    assert (labels[ends] == N).all()
    inner = np.setdiff1d(np.arange(len(ids)), ends)
    assert (labels[inner] == ids[inner] + 1).all()


def test_worked_values():
    assert pack_layout.pack_seq_lens_padded(np.array([3, 5]), 16, 2).tolist() == [4, 12]
    assert pack_layout.position_ids(np.array([4, 12])).tolist() == [0, 1, 2, 3, *range(12)]
    assert pack_layout.apply_loss_mask(np.array([7, 8, 9]), np.array([True, False, True])).tolist() == [7, N, 9]
    assert pack_layout.next_token_labels(np.array([5, 6, 7])).tolist() == [6, 7, N]


def test_errors():
    with pytest.raises(ValueError, match=r"pack_size=10 is not a multiple of 2\*cp_size=4.*use pack_size=12 or 8"):
        pack_layout.pack_seq_lens_padded(np.array([3]), 10, 2)
    with pytest.raises(
        ValueError,
        match=r"take 12 slots \(real lengths \[3, 5\], rounded to multiples of 4\), over pack_size=8",
    ):
        pack_layout.pack_seq_lens_padded(np.array([3, 5]), 8, 2)
    with pytest.raises(ValueError, match="a pack needs at least one sequence"):
        pack_layout.pack_seq_lens_padded(np.array([], dtype=np.int64), 8, 1)
    with pytest.raises(ValueError, match="sequence 1 of the pack has length 0"):
        pack_layout.pack_seq_lens_padded(np.array([3, 0]), 8, 1)
    with pytest.raises(ValueError, match="seq_lens sum to 4 but input_ids has 5 tokens"):
        pack_layout.next_token_labels(np.arange(5), np.array([2, 2]))
