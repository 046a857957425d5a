"""partition_indices: TE's golden vectors (nemo_te_spec.md section 2.2) and input validation."""

from __future__ import annotations

import pytest
import torch

from thdpack.cp import partition_indices

# (cu_seqlens_padded, total, cp_size, per-rank indices): rows 1-8 and 10-14 of the spec's table
GOLDEN = [
    ([0, 8, 16], 16, 2, [[0, 1, 6, 7, 8, 9, 14, 15], [2, 3, 4, 5, 10, 11, 12, 13]]),
    ([0, 8], 8, 2, [[0, 1, 6, 7], [2, 3, 4, 5]]),
    ([0, 4, 12, 24], 24, 2, [[0, 3, 4, 5, 10, 11, 12, 13, 14, 21, 22, 23], [1, 2, 6, 7, 8, 9, 15, 16, 17, 18, 19, 20]]),
    (
        [0, 8, 24, 40],
        40,
        4,
        [
            [0, 7, 8, 9, 22, 23, 24, 25, 38, 39],
            [1, 6, 10, 11, 20, 21, 26, 27, 36, 37],
            [2, 5, 12, 13, 18, 19, 28, 29, 34, 35],
            [3, 4, 14, 15, 16, 17, 30, 31, 32, 33],
        ],
    ),
    ([0, 16, 24], 24, 4, [[0, 1, 14, 15, 16, 23], [2, 3, 12, 13, 17, 22], [4, 5, 10, 11, 18, 21], [6, 7, 8, 9, 19, 20]]),
    ([0, 8, 16], 16, 4, [[0, 7, 8, 15], [1, 6, 9, 14], [2, 5, 10, 13], [3, 4, 11, 12]]),
    ([0, 12], 12, 3, [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]),
    ([0, 4, 8, 16], 16, 2, [[0, 3, 4, 7, 8, 9, 14, 15], [1, 2, 5, 6, 10, 11, 12, 13]]),
    ([0, 8, 16, 16], 16, 2, [[0, 1, 6, 7, 8, 9, 14, 15], [2, 3, 4, 5, 10, 11, 12, 13]]),
    ([0, 0, 8], 8, 2, [[0, 1, 6, 7], [2, 3, 4, 5]]),
    (
        [0, 4, 16, 20, 24, 32],
        32,
        2,
        [[0, 3, 4, 5, 6, 13, 14, 15, 16, 19, 20, 23, 24, 25, 30, 31], [1, 2, 7, 8, 9, 10, 11, 12, 17, 18, 21, 22, 26, 27, 28, 29]],
    ),
    ([0, 4, 8, 20], 20, 2, [[0, 3, 4, 7, 8, 9, 10, 17, 18, 19], [1, 2, 5, 6, 11, 12, 13, 14, 15, 16]]),
    ([0, 8, 16], 16, 1, [list(range(16))]),
]


@pytest.mark.parametrize(("cu", "total", "cp_size", "expected"), GOLDEN)
def test_matches_transformer_engine(cu, total, cp_size, expected):
    cu_t = torch.tensor(cu, dtype=torch.int32)
    for rank, want in enumerate(expected):
        got = partition_indices(cu_t, total, cp_size, rank)
        assert got.dtype == torch.int32
        assert got.tolist() == want


def test_rejects_lengths_not_divisible():
    with pytest.raises(ValueError, match=r"sequence 0 has padded length 6, not a multiple of 2\*cp_size=4"):
        partition_indices(torch.tensor([0, 6, 12]), 12, 2, 0)


def test_rejects_total_mismatch():
    with pytest.raises(ValueError, match=r"total_tokens=12 but cu_seqlens_padded\[-1\]=8"):
        partition_indices(torch.tensor([0, 8]), 12, 2, 0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([0, 8], 8, 0, 0), "cp_size must be >= 1"),
        (([0, 8], 8, 2, 2), r"cp_rank must be in \[0, 2\)"),
        (([4, 8], 8, 2, 0), r"cu_seqlens_padded\[0\] must be 0"),
        (([0, 8, 4], 4, 2, 0), "non-decreasing"),
        (([0], 0, 1, 0), "at least 2 entries"),
    ],
)
def test_rejects_bad_metadata(args, message):
    cu, total, cp, rank = args
    with pytest.raises(ValueError, match=message):
        partition_indices(torch.tensor(cu), total, cp, rank)
