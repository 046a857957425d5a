"""thdpack.format_rules: the CP slot rule and the ignored label, and their one set of errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from thdpack.format_rules import (
    IGNORE_INDEX,
    check_cp_multiple,
    check_cp_size,
    check_pack_size,
    cp_multiple,
    round_up_to_cp,
)


@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.sampled_from([1, 2, 3, 4, 8]))
def test_round_up_to_cp(lengths, cp_size):
    rounded = round_up_to_cp(np.array(lengths), cp_size)
    multiple = cp_multiple(cp_size)
    assert (rounded % multiple == 0).all() and (rounded >= lengths).all() and (rounded - lengths < multiple).all()
    check_cp_multiple(rounded, cp_size)


def test_the_ignored_label_is_torchs_default():
    import torch

    assert IGNORE_INDEX == torch.nn.CrossEntropyLoss().ignore_index == -100


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: cp_multiple(0), ValueError, "cp_size must be >= 1, got 0"),
        (lambda: check_cp_size(2.0), TypeError, "cp_size must be an integer, got 2.0"),
        (lambda: check_cp_size(True), TypeError, "cp_size must be an integer, got True"),
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
