"""partition_indices, shard, unshard: TE's golden vectors (nemo_te_spec.md 2.2), NeMo's sharding
vectors S1-S4 (1.6), invariants on random packs, and input validation."""

from __future__ import annotations

import contextlib
import logging
import sys
import types
from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from thdpack._optional import has_transformer_engine
from thdpack.attention.masks import token_layout
from thdpack.cp import partition as partition_module
from thdpack.cp import partition_indices, shard, unshard
from thdpack.cp.partition import TE_MAX_SEQUENCES, gather_order, gather_order_of, rank_token_indices
from thdpack.thd import collate, split_micro_batches, thd_collate, to_thd
from thdpack.thd.carriage import thd_meta
from thdpack.thd.meta import ThdMeta

from support.thd_cases import C1_SECOND, P5, P6, S3, pack_batches

# (cu_seqlens_padded, total, cp_size, per-rank indices): rows 1-8 and 10-14 of the spec's table
GOLDEN = [
    ([0, 8, 16], 16, 2, [[0, 1, 6, 7, 8, 9, 14, 15], [2, 3, 4, 5, 10, 11, 12, 13]]),
    ([0, 8], 8, 2, [[0, 1, 6, 7], [2, 3, 4, 5]]),
    (
        [0, 4, 12, 24],
        24,
        2,
        [[0, 3, 4, 5, 10, 11, 12, 13, 14, 21, 22, 23], [1, 2, 6, 7, 8, 9, 15, 16, 17, 18, 19, 20]],
    ),
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
    (
        [0, 16, 24],
        24,
        4,
        [[0, 1, 14, 15, 16, 23], [2, 3, 12, 13, 17, 22], [4, 5, 10, 11, 18, 21], [6, 7, 8, 9, 19, 20]],
    ),
    ([0, 8, 16], 16, 4, [[0, 7, 8, 15], [1, 6, 9, 14], [2, 5, 10, 13], [3, 4, 11, 12]]),
    ([0, 12], 12, 3, [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]),
    ([0, 4, 8, 16], 16, 2, [[0, 3, 4, 7, 8, 9, 14, 15], [1, 2, 5, 6, 10, 11, 12, 13]]),
    ([0, 8, 16, 16], 16, 2, [[0, 1, 6, 7, 8, 9, 14, 15], [2, 3, 4, 5, 10, 11, 12, 13]]),
    ([0, 0, 8], 8, 2, [[0, 1, 6, 7], [2, 3, 4, 5]]),
    (
        [0, 4, 16, 20, 24, 32],
        32,
        2,
        [
            [0, 3, 4, 5, 6, 13, 14, 15, 16, 19, 20, 23, 24, 25, 30, 31],
            [1, 2, 7, 8, 9, 10, 11, 12, 17, 18, 21, 22, 26, 27, 28, 29],
        ],
    ),
    ([0, 4, 8, 20], 20, 2, [[0, 3, 4, 7, 8, 9, 10, 17, 18, 19], [1, 2, 5, 6, 11, 12, 13, 14, 15, 16]]),
    ([0, 8, 16], 16, 1, [list(range(16))]),
]


@pytest.mark.parametrize(("cu", "total", "cp_size", "expected"), GOLDEN)
@pytest.mark.parametrize("impl", ["auto", "numpy"])
def test_matches_transformer_engine(cu, total, cp_size, expected, impl):
    cu_t = torch.tensor(cu, dtype=torch.int32)
    for rank, want in enumerate(expected):
        got = partition_indices(cu_t, total, cp_size, rank, impl=impl)
        assert got.dtype == torch.int32
        assert got.tolist() == want


def test_rejects_lengths_not_divisible():
    with pytest.raises(ValueError, match=r"sequence 0 has padded length 6, not a multiple of 2\*cp_size=4"):
        partition_indices(torch.tensor([0, 6, 12]), 12, 2, 0)


def test_rejects_total_mismatch():
    with pytest.raises(
        ValueError,
        match=r"the batch \(total_tokens\) has 12 tokens but the THD layout holds 8 \(cu_seqlens_padded\[-1\]=8\)",
    ):
        partition_indices(torch.tensor([0, 8]), 12, 2, 0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([0, 8], 8, 0, 0), "cp_size must be >= 1, got 0"),
        (([0, 8], 8, 2, 2), r"cp_rank must be an int in \[0, 2\)"),
        (([4, 8], 8, 2, 0), r"cu_seqlens_padded\[0\] must be 0"),
        (([0, 8, 4], 4, 2, 0), "non-decreasing"),
        (([0], 0, 1, 0), "at least 2 entries"),
    ],
)
def test_rejects_bad_metadata(args, message):
    cu, total, cp, rank = args
    with pytest.raises(ValueError, match=message):
        partition_indices(torch.tensor(cu), total, cp, rank)


def _reference_partition(cu, cp_size, rank):
    """TE's closed form, one sequence at a time: chunk r, then chunk 2W-1-r."""
    out = []
    for start, end in pairwise(cu):
        c = (end - start) // (2 * cp_size)
        out += range(start + rank * c, start + (rank + 1) * c)
        out += range(start + (2 * cp_size - 1 - rank) * c, start + (2 * cp_size - rank) * c)
    return out


@st.composite
def _cu_seqlens_padded(draw):
    cp_size = draw(st.integers(1, 4))
    chunks = draw(st.lists(st.integers(0, 6), min_size=1, max_size=12))  # zero-length sequences too
    cu = [0]
    for c in chunks:
        cu.append(cu[-1] + 2 * cp_size * c)
    return cu, cp_size


@given(_cu_seqlens_padded())
def test_matches_the_closed_form_and_partitions_every_token(case):
    cu, cp_size = case
    total = cu[-1]  # 0 too: no token, no index
    seen = []
    for rank in range(cp_size):
        want = _reference_partition(cu, cp_size, rank)
        for impl in ("auto", "numpy"):  # auto = numpy on CPU
            got = partition_indices(torch.tensor(cu, dtype=torch.int32), total, cp_size, rank, impl=impl)
            assert got.dtype == torch.int32 and got.tolist() == want, impl
        seen += want
    assert sorted(seen) == list(range(total))  # disjoint, and their union is every token


def test_rejects_unknown_impl():
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'te', 'numpy'\), got 'cuda'"):
        partition_indices(torch.tensor([0, 8]), 8, 2, 0, impl="cuda")


def test_te_impl_needs_a_cuda_tensor():
    with pytest.raises(ValueError, match="impl='te' runs TE's CUDA kernel, but cu_seqlens_padded is on cpu"):
        partition_indices(torch.tensor([0, 8]), 8, 2, 0, impl="te")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_path_on_cuda_matches_cpu():
    cu = torch.tensor([0, 4, 16, 20, 24, 32], dtype=torch.int32)
    for rank in range(2):
        got = partition_indices(cu.cuda(), 32, 2, rank, impl="numpy")
        assert got.is_cuda and got.cpu().tolist() == partition_indices(cu, 32, 2, rank).tolist()


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and has_transformer_engine()), reason="needs CUDA and Transformer Engine"
)
def test_transformer_engine_kernel_matches_the_host_indices():
    for cu, total, cp_size, expected in GOLDEN:
        cu_cuda = torch.tensor(cu, dtype=torch.int32, device="cuda")
        for rank, want in enumerate(expected):
            assert partition_indices(cu_cuda, total, cp_size, rank, impl="te").cpu().tolist() == want
            assert partition_indices(cu_cuda, total, cp_size, rank).cpu().tolist() == want  # auto picks TE


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and has_transformer_engine()), reason="needs CUDA and Transformer Engine"
)
def test_transformer_engine_guards_on_cuda():
    """TE's kernel refuses T == 0 and cannot launch for more than 12,287 sequences; on another
    GPU than the current one its output lands on cu_seqlens' GPU."""
    empty = partition_indices(torch.zeros(2, dtype=torch.int32, device="cuda"), 0, 2, 0, impl="te")
    assert empty.is_cuda and empty.dtype == torch.int32 and empty.numel() == 0
    many = torch.arange(0, 4 * (TE_MAX_SEQUENCES + 2), 4, dtype=torch.int32)
    got = partition_indices(many.cuda(), int(many[-1]), 2, 1, impl="te")
    assert got.is_cuda and got.cpu().tolist() == _reference_partition(many.tolist(), 2, 1)
    if torch.cuda.device_count() > 1:
        with torch.cuda.device(0):
            other = partition_indices(torch.tensor([0, 8, 16], dtype=torch.int32, device="cuda:1"), 16, 2, 0)
        assert other.device == torch.device("cuda:1") and other.cpu().tolist() == GOLDEN[0][3][0]


# ---- partition_indices' guards around TE's kernel, on the CPU with a recording stand-in for TE ----


class _CudaLooking(torch.Tensor):
    """A CPU tensor that says it is on CUDA, so that partition_indices takes TE's path here."""

    @property
    def is_cuda(self) -> bool:
        return True


@pytest.fixture
def fake_te(monkeypatch):
    """``transformer_engine_torch`` replaced by a module whose ``thd_get_partitioned_indices``
    records each call with the CUDA device current during it (``torch.cuda.device`` recorded too)."""
    calls, current = [], [None]

    def thd_get_partitioned_indices(cu, total_tokens, world_size, rank):
        calls.append({"cu": cu.tolist(), "current_device": current[-1]})
        return torch.tensor(_reference_partition(cu.tolist(), world_size, rank), dtype=torch.int32)

    @contextlib.contextmanager
    def device(where):
        current.append(where)
        try:
            yield
        finally:
            current.pop()

    tex = types.ModuleType("transformer_engine_torch")
    tex.thd_get_partitioned_indices = thd_get_partitioned_indices
    monkeypatch.setitem(sys.modules, "transformer_engine_torch", tex)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(partition_module, "has_transformer_engine", lambda: True)
    return calls


def _cuda_looking(cu: list[int]) -> torch.Tensor:
    return torch.tensor(cu, dtype=torch.int32).as_subclass(_CudaLooking)


def test_te_runs_on_the_device_of_cu_seqlens(fake_te):
    """TE allocates its output on the current CUDA device and launches there: the call runs with
    cu_seqlens' device current, so the indices land beside the batch."""
    cu = _cuda_looking([0, 8, 16])
    for impl in ("te", "auto"):
        got = partition_indices(cu, 16, 2, 1, impl=impl)
        assert got.tolist() == GOLDEN[0][3][1] and got.device == cu.device
    assert [call["current_device"] for call in fake_te] == [cu.device, cu.device]


def test_te_is_not_called_without_tokens(fake_te):
    """TE raises for T == 0 (NVTE_CHECK(total_tokens > 0)); no token has no index."""
    got = partition_indices(_cuda_looking([0, 0, 0]), 0, 2, 1, impl="te")
    assert got.dtype == torch.int32 and got.shape == (0,) and fake_te == []


def test_more_sequences_than_te_s_shared_memory_go_to_the_host(fake_te, caplog):
    """TE's kernel keeps cu_seqlens (S+1 int32) in 48 KiB of dynamic shared memory: at most 12,287
    sequences; beyond, the host computes the same indices, logged once."""
    assert TE_MAX_SEQUENCES == 48 * 1024 // 4 - 1 == 12287
    partition_module._log_too_many_sequences_for_te.cache_clear()
    fits = list(range(0, 4 * (TE_MAX_SEQUENCES + 1), 4))
    assert partition_indices(_cuda_looking(fits), fits[-1], 2, 0, impl="te").tolist() == _reference_partition(
        fits, 2, 0
    )
    assert len(fake_te) == 1  # the most TE takes
    over = [*fits, fits[-1] + 4]
    with caplog.at_level(logging.WARNING, logger="thdpack.cp.partition"):
        for rank in (0, 1):
            got = partition_indices(_cuda_looking(over), over[-1], 2, rank, impl="te")
            assert got.dtype == torch.int32 and got.tolist() == _reference_partition(over, 2, rank)
    assert len(fake_te) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "partition_indices: more than 12287 sequences in one call overflow the shared memory of Transformer "
        "Engine's thd_get_partitioned_indices kernel; computing the indices on the host instead (logged once)"
    ]


# ---- shard: NeMo's end-to-end sharding vectors (nemo_te_spec.md 1.6) ----

F, T_ = False, True


def test_shard_s1_two_cp2_packs():
    thd = thd_collate([P5, C1_SECOND])
    rank0, rank1 = (shard(thd, 2, r) for r in range(2))
    assert rank0["input_ids"].tolist() == [1, 0, 4, 5, 6, 0, 0, 0, 1, 0, 4, 0, 6, 0, 0, 0]
    assert rank0["labels"].tolist() == [
        1,
        -100,
        4,
        5,
        6,
        -100,
        -100,
        -100,
        1,
        -100,
        4,
        -100,
        6,
        -100,
        -100,
        -100,
    ]
    assert rank0["position_ids"].tolist() == [0, 3, 0, 1, 2, 9, 10, 11, 0, 3, 0, 3, 0, 1, 6, 7]
    assert rank0["padding_mask"].tolist() == [F, T_, F, F, F, T_, T_, T_, F, T_, F, T_, F, T_, T_, T_]
    assert rank1["input_ids"].tolist() == [2, 3, 7, 8, 0, 0, 0, 0, 2, 3, 5, 0, 0, 0, 0, 0]
    assert rank1["labels"].tolist() == [2, 3, 7, 8, *[-100] * 4, 2, 3, 5, *[-100] * 5]
    assert rank1["position_ids"].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 1, 2, 2, 3, 4, 5]
    assert rank1["padding_mask"].tolist() == [F, F, F, F, T_, T_, T_, T_, F, F, F, T_, T_, T_, T_, T_]
    for rank, part in enumerate((rank0, rank1)):
        # the GLOBAL metadata, as TE expects (NeMo instead passes cu_seqlens = the padded boundaries)
        assert part["cu_seqlens"].tolist() == [0, 3, 8, 11, 13, 14]
        assert part["cu_seqlens_padded"].tolist() == [0, 4, 16, 20, 24, 32]
        assert part["max_seqlen"] == 12
        assert (thd_meta(part).cp_size, thd_meta(part).cp_rank) == (2, rank) and "cp_rank" not in part


def test_shard_s2_p6_pack():
    rank0, rank1 = (shard(thd_collate([P6]), 2, r) for r in range(2))
    assert rank0["input_ids"].tolist() == [1, 0, 4, 0, 6, 0, 0, 0, 0, 0]
    assert rank0["position_ids"].tolist() == [0, 3, 0, 3, 0, 1, 2, 9, 10, 11]
    assert rank0["labels"].tolist() == [1, -100, 4, -100, 6, *[-100] * 5]
    assert rank1["input_ids"].tolist() == [2, 3, 5, 0, 0, 0, 0, 0, 0, 0]
    assert rank1["position_ids"].tolist() == [1, 2, 1, 2, 3, 4, 5, 6, 7, 8]
    assert rank1["labels"].tolist() == [2, 3, 5, *[-100] * 7]
    assert rank0["max_seqlen"] == rank1["max_seqlen"] == 12


def test_shard_s3_cp4():
    thd = thd_collate([S3])
    assert thd["cu_seqlens_padded"].tolist() == [0, 8, 16] and thd["max_seqlen"] == 8
    want = [
        ([11, 0, 21, 0], [0, 7, 0, 7], [12, -100, 22, -100], [F, T_, F, T_]),
        ([12, 0, 22, 0], [1, 6, 1, 6], [13, -100, 23, -100], [F, T_, F, T_]),
        ([13, 0, 23, 0], [2, 5, 2, 5], [14, -100, -100, -100], [F, T_, F, T_]),
        ([14, 15, 0, 0], [3, 4, 3, 4], [15, -100, -100, -100], [F, F, T_, T_]),
    ]
    for rank, (input_ids, positions, labels, padding) in enumerate(want):
        part = shard(thd, 4, rank)
        assert part["input_ids"].tolist() == input_ids
        assert part["position_ids"].tolist() == positions
        assert part["labels"].tolist() == labels
        assert part["padding_mask"].tolist() == padding


def test_shard_s4_micro_batches():
    chunks = split_micro_batches(collate([P5, C1_SECOND]), 2)
    rank0 = [shard(to_thd(c), 2, 0)["input_ids"].tolist() for c in chunks]
    rank1 = [shard(to_thd(c), 2, 1)["input_ids"].tolist() for c in chunks]
    assert rank0 == [[1, 0, 4, 5, 6, 0, 0, 0], [1, 0, 4, 0, 6, 0, 0, 0]]
    assert rank1 == [[2, 3, 7, 8, 0, 0, 0, 0], [2, 3, 5, 0, 0, 0, 0, 0]]


def test_shard_cp_size_1_keeps_every_token():
    thd = thd_collate([P5])
    part = shard(thd, 1, 0)
    assert part["input_ids"] is thd["input_ids"] and part["thd_meta"] is thd["thd_meta"]
    assert unshard([part], 1).keys() == thd.keys()


def test_shard_reindexes_extra_per_token_tensors():
    thd = thd_collate([dict(P5, inputs_embeds=torch.arange(32.0).view(16, 2))])
    part = shard(thd, 2, 1)
    index = partition_indices(thd["cu_seqlens_padded"], 16, 2, 1).long()
    assert torch.equal(part["inputs_embeds"], thd["inputs_embeds"][index])


# ---- invariants on random packs ----


@given(pack_batches())
def test_shard_invariants(case):
    packs, cp_size = case
    thd = thd_collate(packs)
    T = thd["input_ids"].shape[0]
    shards = [shard(thd, cp_size, r) for r in range(cp_size)]
    if cp_size > 1:  # (cp_size 1 keeps the batch as is: its slots need not be even, as TE's kernel wants)
        owned = torch.cat([partition_indices(thd["cu_seqlens_padded"], T, cp_size, r) for r in range(cp_size)])
        assert sorted(owned.tolist()) == list(range(T))  # disjoint, union = every token
    for part in shards:
        assert part["input_ids"].shape == (T // cp_size,)
        # labels stay aligned with their tokens; padding still comes from the layout
        real = ~part["padding_mask"]
        assert torch.equal(part["labels"][real], 7 * part["input_ids"][real] + 1)
        assert torch.equal(part["padding_mask"], part["is_padding"])
        # positions are the global position inside each sequence (what RoPE needs)
        assert torch.equal(part["position_ids"], token_layout(part).pos_T)
        assert part["cu_seqlens"] is thd["cu_seqlens"] and part["max_seqlen"] == thd["max_seqlen"]
    whole = unshard(shards, cp_size)
    assert whole.keys() == thd.keys()
    for key, value in thd.items():
        assert torch.equal(whole[key], value) if isinstance(value, torch.Tensor) else whole[key] == value


# ---- bad input ----


def test_shard_rejects_a_shard():
    part = shard(thd_collate([P5]), 2, 0)
    with pytest.raises(ValueError, match="already CP rank 0's shard of cp_size=2; shard the global batch"):
        shard(part, 2, 1)


def test_shard_rejects_per_token_tensors_of_another_length():
    thd = dict(thd_collate([P5]), loss_mask=torch.ones(15))
    with pytest.raises(
        ValueError, match=r"loss_mask has 15 tokens but the THD layout holds 16 \(cu_seqlens_padded\[-1\]=16\)"
    ):
        shard(thd, 2, 0)


def test_shard_rejects_lengths_cp_cannot_split():
    with pytest.raises(ValueError, match=r"sequence 0 has padded length 4, not a multiple of 2\*cp_size=8"):
        shard(thd_collate([P5]), 4, 0)


def test_unshard_rejects_bad_shard_lists():
    thd = thd_collate([P5, C1_SECOND])
    shards = [shard(thd, 2, r) for r in range(2)]
    with pytest.raises(ValueError, match="unshard got 1 shards for cp_size=2"):
        unshard(shards[:1], 2)
    with pytest.raises(ValueError, match=r"shards\[0\] has cp_size=2, cp_rank=1; expected cp_size=2, cp_rank=0"):
        unshard(shards[::-1], 2)
    other = shard(thd_collate([C1_SECOND, P5]), 2, 1)
    with pytest.raises(ValueError, match=r"shards\[1\] has a different cu_seqlens than shards\[0\]"):
        unshard([shards[0], other], 2)
    with pytest.raises(ValueError, match=r"shards\[1\] has keys"):
        unshard([shards[0], dict(shards[1], extra="x")], 2)


def test_one_rank_keeps_every_token_whatever_the_slot_widths():
    """TE's formula gives the identity for one rank, also on odd slots (which TE's kernel refuses)."""
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    for impl in ("auto", "numpy"):
        assert partition_indices(cu, 8, 1, 0, impl=impl).tolist() == list(range(8))


def test_unshard_rejects_shards_that_hold_other_tokens():
    thd = thd_collate([P5, C1_SECOND])
    shards = [shard(thd, 2, r) for r in range(2)]
    short = dict(shards[1], labels=shards[1]["labels"][:-1])
    with pytest.raises(
        ValueError, match=r"labels of all shards together has 31 tokens but the THD layout holds 32 \(cu_seqlens_padded"
    ):
        unshard([shards[0], short], 2)


@given(_cu_seqlens_padded())
def test_a_records_rank_indices_and_gather_order_are_the_partitions(case):
    """rank_token_indices is TE's partition of the record's batch; gather_order inverts the ranks' rows stacked."""
    cu, cp_size = case
    total = cu[-1]
    if total == 0:
        return
    lengths = [b - a for a, b in pairwise(cu)]
    meta = ThdMeta.from_lengths(lengths, lengths, cp_size=cp_size, cp_rank=cp_size - 1)
    stacked = []
    for rank in range(cp_size):
        index = rank_token_indices(meta, rank)
        assert index.dtype == np.int64 and index.tolist() == _reference_partition(cu, cp_size, rank)
        stacked += index.tolist()
    assert rank_token_indices(meta).tolist() == _reference_partition(cu, cp_size, cp_size - 1)  # the record's rank
    order = gather_order(meta, "cpu")
    assert order.global_of_gathered_T.tolist() == stacked
    assert torch.equal(order.global_of_gathered_T[order.gathered_of_global_T], torch.arange(total))


@pytest.mark.parametrize(
    ("rank_indices", "message"),
    [
        ([[0, 1, 2], [3]], r"CP ranks hold \[3, 1\] tokens; the all-gather and the all-to-all exchange equal blocks"),
        ([[0, 1], [1, 3]], r"token 2 is held by no rank \(1 missing in all\)"),
        ([[0, 7], [1, 2]], r"token 3 is held by no rank \(1 missing in all\)"),
    ],
)
def test_gather_order_refuses_index_maps_that_are_not_a_partition(rank_indices, message):
    with pytest.raises(ValueError, match=message):
        gather_order_of([np.array(index) for index in rank_indices])
