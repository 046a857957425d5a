"""THD metadata validation, its per-batch cache, and the per-token sides the kernels read."""

from __future__ import annotations

import pytest
import torch
from _attention_cases import make_thd, shard_of
from hypothesis import given
from hypothesis import strategies as st

from thdpack.attention.backends.base import kernel_cu_seqlens
from thdpack.cp import local_placement
from thdpack.thd.meta import thd_meta
from thdpack.thd.tokens import global_placement

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
        ({"cu_seqlens": _i32([[0, 4]])}, ValueError, r"1-D with at least 2 entries \(S\+1\), got shape \(1, 2\)"),
        (
            {"cu_seqlens": _i32([0, 3, 9]), "cu_seqlens_padded": _i32([0, 4, 8])},
            ValueError,
            "sequence 1 has 6 real tokens but a padded slot of 4",
        ),
        (
            {"cu_seqlens": _i32([0, 3]), "cu_seqlens_padded": _i32([0, 4, 8])},
            ValueError,
            "cu_seqlens has 2 entries but cu_seqlens_padded has 3",
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
            r"cp_rank must be an int in \[0, 2\)",
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
        side = local_placement(thd_meta(shard), CPU)
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
    assert torch.equal(global_placement(thd_meta(thd), CPU).valid_T, real)


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


def _pack(seq_lens, seq_lens_padded):
    total = sum(seq_lens_padded)
    return {
        "input_ids": torch.arange(1, total + 1),
        "labels": torch.arange(2, total + 2),
        "position_ids": torch.zeros(total, dtype=torch.long),
        "seq_lens": torch.tensor(seq_lens),
        "seq_lens_padded": torch.tensor(seq_lens_padded),
    }


def test_the_record_is_built_once_where_the_batch_is_made(monkeypatch):
    """thd_collate validates; shard, thd_to_device, masks, the loss and every attention layer of a
    2-layer model look the record up instead of validating again."""
    from thdpack.attention.masks import block_causal_mask
    from thdpack.cp import shard
    from thdpack.loss import loss_weights
    from thdpack.models import ModelConfig, Transformer
    from thdpack.thd import meta as meta_module
    from thdpack.thd import thd_collate, thd_to_device

    calls = []
    real_from_lengths = meta_module.ThdMeta.from_lengths.__func__

    def counting(cls, *args, **kwargs):
        calls.append(kwargs.get("cp_size", 1))
        return real_from_lengths(cls, *args, **kwargs)

    monkeypatch.setattr(meta_module.ThdMeta, "from_lengths", classmethod(counting))
    thd = thd_collate([_pack([3, 5], [4, 12]), _pack([2, 2, 8], [4, 4, 8])])
    assert calls == [1]
    local = thd_to_device(shard(thd, 2, 1), "cpu")
    model = Transformer(ModelConfig.preset("tiny", n_layers=2, attention_backend="math"), seed=0)
    model(thd_to_device(thd, "cpu"))
    block_causal_mask(local)
    loss_weights(thd["labels"], thd["cu_seqlens_padded"], reduction="token_mean")
    assert calls == [1]  # nothing was validated a second time


def test_a_replaced_or_modified_cu_seqlens_is_validated_again():
    from thdpack.thd import thd_collate

    thd = thd_collate([_pack([3, 5], [4, 12])])
    made = thd_meta(thd)
    assert thd_meta(dict(thd)) is made
    whole = torch.tensor([0, 16], dtype=torch.int32)  # a planted fault: one sequence over the pack
    replaced = thd_meta({**thd, "cu_seqlens": whole, "cu_seqlens_padded": whole, "max_seqlen": 16})
    assert replaced.lengths == (16,) and replaced is not made
    thd["cu_seqlens"][1] = 5  # in place: 5 real tokens in a slot of 4
    with pytest.raises(ValueError, match="sequence 0 has 5 real tokens but a padded slot of 4"):
        thd_meta(thd)


def test_one_fault_one_message_at_every_entry_point():
    """A slot that is not a multiple of 2*cp_size, caught by shard, partition_indices, thd_meta,
    validate_thd and thd_attention: the same words everywhere."""
    from thdpack.attention import thd_attention
    from thdpack.cp import partition_indices, shard
    from thdpack.thd import thd_collate, validate_thd

    thd = thd_collate([_pack([3, 5], [6, 10])])
    message = r"sequence 0 has padded length 6, not a multiple of 2\*cp_size=4; pad every sequence to a multiple of 4"
    shard_view = {**thd, "cp_size": 2, "cp_rank": 0}
    q = torch.zeros(8, 1, 2)
    for check in (
        lambda: shard(thd, 2, 0),
        lambda: partition_indices(thd["cu_seqlens_padded"], 16, 2, 0),
        lambda: thd_meta(shard_view),
        lambda: validate_thd(shard_view),
        lambda: thd_attention(q, q, q, shard_view, backend="math"),
    ):
        with pytest.raises(ValueError, match=message):
            check()


def test_the_record_survives_pickling_without_its_cache():
    import pickle

    from thdpack.thd import thd_collate

    meta = thd_meta(thd_collate([_pack([3, 5], [4, 12])]))
    global_placement(meta, CPU)
    assert any(key[0] == "global placement" for key in meta._cache if isinstance(key, tuple))
    again = pickle.loads(pickle.dumps(meta))
    assert again._cache == {} and again == meta and not again.lengths_S.flags.writeable
