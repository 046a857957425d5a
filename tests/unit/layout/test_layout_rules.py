"""thdpack.layout.rules: the slot rule (per group, and TE's with g = cp_size), the CP sizes and groups,
the ignored label, and their one set of errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from thdpack.layout.rules import (
    IGNORE_INDEX,
    check_cp,
    check_cp_multiple,
    check_cp_size,
    check_groups,
    check_pack_size,
    cp_multiple,
    group_options,
    group_sizes,
    round_up_to_cp,
    slot_lengths,
    slot_multiple,
)


@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.sampled_from([1, 2, 3, 4, 8]))
def test_round_up_to_cp(lengths, cp_size):
    rounded = round_up_to_cp(np.array(lengths), cp_size)
    multiple = cp_multiple(cp_size)
    assert (rounded % multiple == 0).all() and (rounded >= lengths).all() and (rounded - lengths < multiple).all()
    check_cp_multiple(rounded, cp_size)


@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.sampled_from([1, 2, 3, 4, 6, 8]))
def test_te_rule_is_the_group_rule_with_every_group_all_ranks(lengths, cp_size):
    lengths = np.array(lengths)
    assert cp_multiple(cp_size) == slot_multiple(cp_size)
    assert round_up_to_cp(lengths, cp_size).tolist() == slot_lengths(lengths, np.full(len(lengths), cp_size)).tolist()


def test_slot_rule_per_group():
    """A split sequence takes a multiple of 2g, a whole one (g == 1) exactly its length."""
    assert [slot_multiple(g) for g in (1, 2, 3, 4, 8)] == [1, 4, 6, 8, 16]
    assert slot_multiple(np.array([1, 2, 6])).tolist() == [1, 4, 12]
    assert slot_lengths(np.array([5, 5, 5, 1, 0]), np.array([1, 2, 4, 8, 2])).tolist() == [5, 8, 8, 16, 0]


def test_group_sizes_and_options():
    assert group_sizes(8) == (1, 2, 4, 8)
    assert group_sizes(12) == (1, 2, 4, 12)
    assert group_sizes(3) == (1, 3)
    size_O, start_O = group_options(8, (1, 8))
    assert size_O.tolist() == [8] + [1] * 8 and start_O.tolist() == [0, *range(8)]
    with pytest.raises(ValueError, match="group size 3 is not allowed for cp_size=4; valid: "):
        group_options(4, (3,))


def test_a_group_past_the_last_rank_names_the_entry_its_group_and_the_valid_sizes():
    with pytest.raises(
        ValueError,
        match=r"pack 2: sequence 5 is placed on ranks 2..5 \(a group of 4 starting at rank 2\); a group of 4 must "
        r"start at a multiple of 4 in \[0, 0\] \(groups are aligned; valid group sizes for cp_size=4: 1, 2, 4\)",
    ):
        check_groups(np.array([4, 4]), np.array([0, 2]), 4, lambda s: f"pack 2: sequence {s + 4}")


def test_the_ignored_label_is_torchs_default():
    import torch

    assert IGNORE_INDEX == torch.nn.CrossEntropyLoss().ignore_index == -100


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: cp_multiple(0), ValueError, "cp_size must be >= 1, got 0"),
        (lambda: check_cp_size(2.0), TypeError, "cp_size must be an integer, got 2.0"),
        (lambda: check_cp_size(True), TypeError, "cp_size must be an integer, got True"),
        (lambda: group_sizes(0), ValueError, "cp_size must be >= 1, got 0"),
        (lambda: check_cp(4, 4), ValueError, r"cp_rank must be an int in \[0, 4\), got 4"),
        (lambda: check_cp(2, True), ValueError, r"cp_rank must be an int in \[0, 2\), got True"),
        (
            lambda: check_pack_size(10, 2),
            ValueError,
            r"pack_size=10 is not a multiple of 2\*cp_size=4.*use pack_size=12 or 8",
        ),
        (lambda: check_pack_size(2, 2), ValueError, r"use pack_size=4$"),
        (lambda: check_pack_size(0, 1), ValueError, "pack_size must be >= 1, got 0"),
        (lambda: check_pack_size(64.0, 1), TypeError, "pack_size must be an integer, got 64.0"),
        (
            lambda: check_cp_multiple(np.array([8, 6]), 2, lambda s: f"pack 3: sequence {s}"),
            ValueError,
            r"pack 3: sequence 1 has padded length 6, not a multiple of 2\*cp_size=4",
        ),
    ],
)
def test_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_numpy_integers_are_integers():
    assert check_cp_size(np.int64(4)) == 4 and isinstance(check_cp_size(np.int64(4)), int)
    check_pack_size(np.int32(16), np.int64(2))
