"""THD metadata validation, its per-batch cache, and the per-token sides the kernels read."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from thdpack.cp.partition import local_placement
from thdpack.thd.carriage import thd_meta
from thdpack.thd.meta import ThdMeta
from thdpack.thd.tokens import global_placement, real_rows

from support.attention_cases import make_thd, shard_of

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


def test_cu_tensor_is_int32_on_the_kernels_device():
    thd = {"cu_seqlens": torch.tensor([0, 4, 9]), "cu_seqlens_padded": _i32([0, 4, 10])}
    meta = thd_meta(thd)
    with pytest.raises(
        TypeError,
        match=r"cu_seqlens must be int32 \(what TE and FlashAttention kernels take\), got torch.int64; thdpack.to_thd",
    ):
        meta.cu_tensor("cu_seqlens", CPU)
    assert meta.cu_tensor("cu_seqlens_padded", CPU) is thd["cu_seqlens_padded"]
    with pytest.raises(ValueError, match="cu_seqlens_padded is on cpu but q/k/v are on meta"):
        meta.cu_tensor("cu_seqlens_padded", torch.device("meta"))
    no_padding = {"cu_seqlens": _i32([0, 4])}
    assert thd_meta(no_padding).cu_tensor("cu_seqlens_padded", CPU) is no_padding["cu_seqlens"]


def _pack(seq_lens, seq_lens_padded):
    total = sum(seq_lens_padded)
    real = torch.from_numpy(real_rows(np.array(seq_lens_padded), np.array(seq_lens)))
    return {
        "input_ids": torch.arange(1, total + 1),
        "labels": torch.arange(2, total + 2).where(real, -100),  # padding predicts nothing
        "position_ids": torch.zeros(total, dtype=torch.long),
        "seq_lens": torch.tensor(seq_lens),
        "seq_lens_padded": torch.tensor(seq_lens_padded),
    }


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


# ---- the record travels with its batch ----


class _Validations:
    """Counts the records built from lengths (every validation builds one), per cp_size."""

    def __init__(self, monkeypatch):
        from thdpack.thd import meta as meta_module

        self.calls = []
        real = meta_module.ThdMeta.from_lengths.__func__

        def counting(cls, *args, **kwargs):
            self.calls.append(kwargs.get("cp_size", 1))
            return real(cls, *args, **kwargs)

        monkeypatch.setattr(meta_module.ThdMeta, "from_lengths", classmethod(counting))


def _two_packs():
    from thdpack.thd import thd_collate

    return thd_collate([_pack([3, 5], [4, 12]), _pack([2, 2, 8], [4, 4, 8])])


def _use_everywhere(thd):
    """Shard, move, attend (a 2-layer model, every layer), mask and weigh ``thd``; returns the shard."""
    from thdpack.attention.masks import block_causal_mask
    from thdpack.cp import shard
    from thdpack.loss import loss_weights
    from thdpack.models import ModelConfig, Transformer
    from thdpack.thd import thd_to_device, validate_thd

    local = thd_to_device(shard(thd, 2, 1), "cpu")
    model = Transformer(ModelConfig.preset("tiny", n_layers=2, attention_backend="math"), seed=0)
    model(thd_to_device(thd, "cpu"))
    block_causal_mask(local)
    validate_thd(local)
    loss_weights(thd["labels"], thd_meta(thd), reduction="sequence_mean")
    return local


def test_the_record_is_built_once_where_the_batch_is_made(monkeypatch):
    """thd_collate validates; shard, thd_to_device, masks, validate_thd, the loss and every attention
    layer of a 2-layer model take the record from the batch instead of validating again."""
    validations = _Validations(monkeypatch)
    thd = _two_packs()
    assert validations.calls == [1] and isinstance(thd["thd_meta"], ThdMeta)
    local = _use_everywhere(thd)
    assert validations.calls == [1]  # nothing was validated a second time
    assert (local["thd_meta"].cp_size, local["thd_meta"].cp_rank) == (2, 1) and "cp_rank" not in local


def test_the_record_moves_with_the_batch_and_reads_no_tensor_there(monkeypatch):
    """On the meta device no tensor can be read back: thd_meta, shard and the placements still work,
    because the moved batch carries its record (describing the moved tensors)."""
    from thdpack.cp import shard
    from thdpack.cp.partition import local_placement
    from thdpack.thd import thd_to_device

    thd = _two_packs()
    validations = _Validations(monkeypatch)
    moved = thd_to_device(thd, "meta")
    assert moved["cu_seqlens"].is_meta and thd_meta(moved) == thd_meta(thd)
    assert thd_meta(moved) is not thd_meta(thd)  # a twin that describes the moved tensors
    part = shard(moved, 2, 0)
    assert part["input_ids"].shape == (16,) and part["input_ids"].is_meta
    assert local_placement(thd_meta(part), "cpu").num_rows == 16
    assert validations.calls == []


def test_the_record_survives_pickling_with_its_batch(monkeypatch):
    import pickle

    thd = _two_packs()
    again = pickle.loads(pickle.dumps(thd))
    assert again["cu_seqlens"] is not thd["cu_seqlens"]
    validations = _Validations(monkeypatch)
    assert thd_meta(again) is again["thd_meta"] and again["thd_meta"] == thd["thd_meta"]
    _use_everywhere(again)
    assert validations.calls == []


def test_the_record_comes_out_of_a_dataloader_worker(monkeypatch):
    """Built in the worker (thd_collate as collate_fn), used in this process without validating again."""
    from torch.utils.data import DataLoader

    from thdpack.thd import thd_collate

    packs = [_pack([3, 5], [4, 12]), _pack([2, 2, 8], [4, 4, 8])]
    loader = DataLoader(packs, batch_size=2, collate_fn=thd_collate, num_workers=1)
    validations = _Validations(monkeypatch)  # counts in this process only: the worker's call is not here
    (batch,) = list(loader)
    assert thd_meta(batch) is batch["thd_meta"] and batch["thd_meta"].lengths == (3, 5, 2, 2, 8)
    _use_everywhere(batch)
    assert validations.calls == []


def test_a_stale_record_is_never_used():
    """Replaced cu_seqlens, changed in place, moved outside thdpack, or contradicted by the batch's keys:
    the record no longer describes the batch, and thd_meta builds the batch's own (stored in its place)."""
    thd = _two_packs()
    made = thd["thd_meta"]
    assert thd_meta(dict(thd)) is made and thd_meta({**thd, "loss_weights": thd["labels"]}) is made
    whole = torch.tensor([0, 32], dtype=torch.int32)  # a planted fault: one sequence over both packs
    replaced = {**thd, "cu_seqlens": whole, "cu_seqlens_padded": whole, "max_seqlen": 32}
    assert thd_meta(replaced).lengths == (32,) and replaced["thd_meta"] is not made
    moved = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in thd.items()}
    assert thd_meta(moved) == made and moved["thd_meta"] is not made  # the same layout, its own tensors
    relabelled = {**thd, "max_seqlen": 16}
    assert thd_meta(relabelled).max_seqlen == 16
    thd["cu_seqlens"][1] = 5  # in place: 5 real tokens in a slot of 4
    with pytest.raises(ValueError, match="sequence 0 has 5 real tokens but a padded slot of 4"):
        thd_meta(thd)
    with pytest.raises(TypeError, match="thd\\['thd_meta'\\] must be a thdpack ThdMeta, got dict"):
        thd_meta({**moved, "thd_meta": {}})


def test_a_stale_shard_record_keeps_its_rank_unless_the_keys_say_otherwise():
    """No tensor says which CP rank's shard a batch is: a rebuilt record keeps the stale one's
    cp_size / cp_rank, and cp_size / cp_rank keys (a batch made elsewhere) override both."""
    from thdpack.cp import shard

    part = shard(_two_packs(), 2, 1)
    moved = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in part.items()}
    assert (thd_meta(moved).cp_size, thd_meta(moved).cp_rank) == (2, 1) and moved["thd_meta"] is not part["thd_meta"]
    claimed = {**part, "cp_rank": 0}  # verify's planted fault: another rank's tokens under this rank's name
    assert thd_meta(claimed).cp_rank == 0 and thd_meta(claimed) is claimed["thd_meta"]


def test_a_dict_made_elsewhere_is_validated_once(monkeypatch):
    """NeMo's / TE's dicts carry no record: the first thd_meta validates and stores one in the dict."""
    thd = make_thd([3, 9], 2)
    assert "thd_meta" not in thd
    validations = _Validations(monkeypatch)
    first = thd_meta(thd)
    assert thd["thd_meta"] is first and thd_meta(thd) is first and validations.calls == [1]
    frozen = types.MappingProxyType(make_thd([3, 9], 2))  # a mapping it cannot store into: validated each time
    assert thd_meta(frozen) == first and "thd_meta" not in frozen


# ---- the checks of a layout, one method each ----


def test_token_count_check_names_the_tensor_and_the_layout():
    meta = ThdMeta.from_lengths([3, 5], [4, 12], cp_size=2, cp_rank=1)
    meta.check_token_count(8, "input_ids")
    with pytest.raises(
        ValueError,
        match=r"^input_ids has 16 tokens but the THD layout holds 8 \(cu_seqlens_padded\[-1\]=16 / cp_size=2, on CP "
        r"rank 1\); every per-token tensor needs one row per token of the slots cu_seqlens_padded describes",
    ):
        meta.check_token_count(16, "input_ids")


def test_the_cp_multiple_is_the_plan_rule():
    from thdpack.layout.rules import cp_multiple

    for cp_size in (2, 3, 4):
        ThdMeta.from_lengths([1], [cp_multiple(cp_size)], cp_size=cp_size)
        with pytest.raises(ValueError, match=rf"not a multiple of 2\*cp_size={cp_multiple(cp_size)}"):
            ThdMeta.from_lengths([1], [cp_multiple(cp_size) + 2], cp_size=cp_size)


def test_local_placement_honours_the_rank_or_refuses_it():
    meta = ThdMeta.from_lengths([3, 4], [4, 4], cp_size=2, cp_rank=0)
    assert local_placement(meta, CPU, 1).pos_T.tolist() == [1, 2, 1, 2]
    assert local_placement(meta, CPU).pos_T.tolist() == [0, 3, 0, 3]
    whole = ThdMeta.from_lengths([3, 4], [4, 4])
    assert local_placement(whole, CPU, 0) is local_placement(whole, CPU)
    for rank in (1, -1):  # a global record has one rank: silently giving rank 0's rows would be wrong
        with pytest.raises(ValueError, match=rf"cp_rank must be an int in \[0, 1\), got {rank}"):
            local_placement(whole, CPU, rank)
    with pytest.raises(ValueError, match=r"cp_rank must be an int in \[0, 2\), got 2"):
        local_placement(meta, CPU, 2)


def test_unsharded_and_for_rank_share_the_arrays():
    whole = ThdMeta.from_lengths([3, 4], [4, 4])
    part = whole.for_rank(2, 1)
    assert part.unsharded() == whole and whole.unsharded() is whole
    assert part.lengths_padded_S is whole.lengths_padded_S
