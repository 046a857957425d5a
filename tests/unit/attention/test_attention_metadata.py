"""THD metadata validation, its per-batch cache, and the per-token sides the kernels read."""

from __future__ import annotations

import pytest
import torch
from _attention_cases import make_thd, shard_of
from hypothesis import given
from hypothesis import strategies as st

from thdpack.attention.metadata import kernel_cu_seqlens, thd_meta

CPU = torch.device("cpu")


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize(
    ("thd", "error", "message"),
    [
        ({}, ValueError, "thd has no 'cu_seqlens'; pass the mapping returned by thdpack.to_thd"),
        ({"cu_seqlens": [0, 4]}, TypeError, "cu_seqlens must be a torch.Tensor, got list"),
        ({"cu_seqlens": torch.tensor([0.0, 4.0])}, TypeError, "must be an integer tensor"),
        ({"cu_seqlens": _i32([3, 4])}, ValueError, r"cu_seqlens\[0\] must be 0, got 3"),
        ({"cu_seqlens": _i32([0, 5, 4])}, ValueError, r"non-decreasing; it drops at entry 2 \(5 -> 4\)"),
        ({"cu_seqlens": _i32([[0, 4]])}, ValueError, r"1-D with at least 2 entries, got shape \(1, 2\)"),
        (
            {"cu_seqlens": _i32([0, 3, 9]), "cu_seqlens_padded": _i32([0, 4, 8])},
            ValueError,
            "sequence 1 has 6 real tokens but a padded slot of 4",
        ),
        (
            {"cu_seqlens": _i32([0, 3]), "cu_seqlens_padded": _i32([0, 4, 8])},
            ValueError,
            "cu_seqlens has 2 entries and cu_seqlens_padded 3",
        ),
        (
            {
                "cu_seqlens": _i32([0, 5, 9]),
                "cu_seqlens_padded": _i32([0, 6, 10]),
                "cp_size": 2,
                "cp_rank": 0,
            },
            ValueError,
            r"sequence 0 has padded length 6, not a multiple of 2\*cp_size=4; pad every sequence",
        ),
        (
            {"cu_seqlens": _i32([0, 4]), "cp_size": 2, "cp_rank": 2},
            ValueError,
            r"cp_rank must be in \[0, 2\)",
        ),
        ({"cu_seqlens": _i32([0, 4, 16]), "max_seqlen": 8}, ValueError, r"max_seqlen=8 is below the widest"),
        (
            {"cu_seqlens": _i32([0, 4]), "max_seqlen": torch.tensor(4)},
            TypeError,
            "max_seqlen must be a Python int",
        ),
    ],
)
def test_bad_metadata_is_rejected_with_the_fix(thd, error, message):
    with pytest.raises(error, match=message):
        thd_meta(thd)


def test_metadata_is_read_once_per_batch():
    thd = make_thd([3, 9], 2)
    first = thd_meta(thd)
    assert thd_meta(dict(thd)) is first  # same tensors: the cached metadata
    assert thd_meta({**thd, "cp_size": 2, "cp_rank": 1}) is not first  # another shard
    thd["cu_seqlens_padded"][2] += 0  # an in-place write bumps the version: validated again
    assert thd_meta(thd) is not first


def test_missing_fields_default_to_an_unpadded_unsharded_batch():
    meta = thd_meta({"cu_seqlens": _i32([0, 3, 7])})
    assert (meta.lengths, meta.lengths_padded, meta.max_seqlen, meta.cp_size) == ((3, 4), (3, 4), 4, 1)
    assert not meta.has_padding


@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=5),
    cp_size=st.integers(1, 4),
    tail=st.integers(0, 2),
)
def test_local_sides_describe_the_partition(lengths, cp_size, tail):
    thd = make_thd(lengths, cp_size, multiple=2 * cp_size, tail=2 * cp_size * tail)
    total = int(thd["cu_seqlens_padded"][-1])
    seg = torch.repeat_interleave(torch.arange(len(lengths)), thd["cu_seqlens_padded"].diff().long())
    pos = torch.arange(total) - thd["cu_seqlens_padded"].long()[seg]
    real = pos < torch.tensor(lengths)[seg]
    for rank in range(cp_size):
        shard, index = shard_of(thd, cp_size, rank)
        side = thd_meta(shard).local_side(CPU)
        assert torch.equal(side.pos_T, pos[index])
        assert torch.equal(side.seg_T, seg[index])
        assert torch.equal(side.valid_T, real[index])  # real tokens are a prefix of each sequence's rows
        for back in (False, True):
            half = side.half(back)
            rows = side.half_index(back)
            assert torch.equal(half.pos_T, pos[index][rows]) and torch.equal(half.valid_T, real[index][rows])
            assert torch.equal(half.seg_T, seg[index][rows])
            chunk_ids = pos[index][rows] // (
                torch.tensor(thd_meta(thd).lengths_padded)[seg[index][rows]] // (2 * cp_size)
            )
            assert chunk_ids.eq(2 * cp_size - 1 - rank if back else rank).all()  # TE's chunk r / 2cp-1-r
    assert torch.equal(thd_meta(thd).global_side(CPU).valid_T, real)


def test_kernel_cu_seqlens_requires_int32_on_the_device():
    thd = {"cu_seqlens": torch.tensor([0, 4, 9]), "cu_seqlens_padded": _i32([0, 4, 10])}
    with pytest.raises(
        TypeError, match=r"cu_seqlens has dtype torch.int64, but the 'varlen' backend's kernels need int32"
    ):
        kernel_cu_seqlens(thd, "cu_seqlens", "varlen", CPU)
    assert kernel_cu_seqlens(thd, "cu_seqlens_padded", "flash", CPU) is thd["cu_seqlens_padded"]
    with pytest.raises(ValueError, match="cu_seqlens_padded is on cpu but q/k/v are on meta"):
        kernel_cu_seqlens(thd, "cu_seqlens_padded", "te", torch.device("meta"))
    no_padding = {"cu_seqlens": _i32([0, 4])}
    assert kernel_cu_seqlens(no_padding, "cu_seqlens_padded", "te", CPU) is no_padding["cu_seqlens"]
