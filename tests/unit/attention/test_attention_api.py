"""``thd_attention``: results through the front door, and every bad input rejected with its fix."""

from __future__ import annotations

import dataclasses
import logging
import sys
import types

import pytest
import torch

from thdpack.attention import AttentionConfig, reference_attention, select, thd_attention
from thdpack.attention.backends import flash
from thdpack.attention.backends.base import AttentionCall
from thdpack.attention.select import ENV_VAR
from thdpack.cp import shard as cp_shard
from thdpack.cp.topology import CpTopology
from thdpack.thd import thd_collate
from thdpack.thd.carriage import thd_meta

from support.attention_cases import make_thd, random_case, reference_results
from support.placement_cases import MIXED_PACKS, placed_metadata
from support.thd_cases import P5


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(select, "_LOGGED", set())


@pytest.mark.parametrize("causal", [True, False])
def test_front_door_matches_reference_with_lse_and_custom_scale(causal):
    thd = make_thd([7, 1, 12], multiple=4, tail=4)
    case = random_case(thd, 4, 2, 8, torch.float64, seed=11)
    q, k, v = (case[n].clone().requires_grad_() for n in ("q", "k", "v"))
    out, lse = thd_attention(q, k, v, thd, causal=causal, softmax_scale=0.2, return_lse=True)
    want_out, want_lse = reference_attention(case["q"], case["k"], case["v"], thd, causal=causal, softmax_scale=0.2)
    valid = case["valid"]
    assert out.shape == (len(valid), 4, 8) and lse.shape == (4, len(valid))
    assert torch.allclose(out[valid], want_out[valid], atol=1e-12)
    assert torch.allclose(lse[:, valid], want_lse[:, valid], atol=1e-12)
    plain = thd_attention(q, k, v, thd, causal=causal, softmax_scale=0.2)
    assert torch.equal(plain, out)  # without return_lse: just the output


def test_default_scale_and_gradients_through_the_front_door():
    thd = make_thd([5, 9], multiple=2)
    case = random_case(thd, 2, 2, 4, torch.float64, seed=3)
    q, k, v = (case[n].clone().requires_grad_() for n in ("q", "k", "v"))
    out = thd_attention(q, k, v, thd, backend="math")
    dq, dk, dv = torch.autograd.grad((out * case["dout"]).sum(), (q, k, v))
    want = reference_results(case, thd, True, with_dlse=False)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.allclose(got, want[name], atol=1e-12), name


def test_the_auto_choice_is_logged(caplog):
    thd = make_thd([4, 4])
    x = torch.randn(8, 2, 4, dtype=torch.float16)
    with caplog.at_level(logging.INFO, logger="thdpack.attention"):
        out = thd_attention(x, x, x, thd)
    assert out.dtype == torch.float16
    assert any("backend 'math' on cpu float16" in r.getMessage() for r in caplog.records)


def _qkv(tokens=8, nq=2, nkv=2, head_dim=4, dtype=torch.float32):
    return (
        torch.randn(tokens, nq, head_dim, dtype=dtype),
        torch.randn(tokens, nkv, head_dim, dtype=dtype),
        torch.randn(tokens, nkv, head_dim, dtype=dtype),
    )


THD = make_thd([3, 5])


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        (
            (torch.randn(8, 8), *_qkv()[1:]),
            {},
            ValueError,
            r"q must be \(tokens, heads, head_dim\), got shape \(8, 8\)",
        ),
        ((*_qkv()[:2], torch.randn(8, 2, 4).long()), {}, TypeError, "v must be a floating-point tensor"),
        ((_qkv()[0].double(), *_qkv()[1:]), {}, TypeError, "q, k, v must share one dtype"),
        ((*_qkv()[:2], torch.randn(7, 2, 4)), {}, ValueError, "same number of tokens, got 8, 8, 7"),
        (
            (*_qkv(nq=3, nkv=2)[:2], torch.randn(8, 2, 4)),
            {},
            ValueError,
            "q has 3 heads, not a multiple of k/v's 2",
        ),
        (
            (_qkv()[0], torch.randn(8, 2, 4), torch.randn(8, 1, 4)),
            {},
            ValueError,
            "k and v must have the same number of heads",
        ),
        (
            (_qkv()[0], torch.randn(8, 2, 5), torch.randn(8, 2, 4)),
            {},
            ValueError,
            "same head dim, got 4 and 5",
        ),
        (_qkv(tokens=10), {}, ValueError, r"q has 10 tokens but the THD layout holds 8 \(cu_seqlens_padded\[-1\]=8\)"),
        (_qkv(), {"backend": "fastest"}, ValueError, "unknown attention backend 'fastest'"),
        (
            _qkv(),
            {"cp_comm_type": "ring"},
            ValueError,
            "unknown cp_comm_type 'ring'; valid: 'p2p', 'all_gather', 'a2a'",
        ),
        (_qkv(), {"softmax_scale": 0.0}, ValueError, "softmax_scale must be > 0"),
        (
            _qkv(),
            {"backend": "sdpa", "return_lse": True},
            ValueError,
            "backend 'sdpa' does not return the LSE",
        ),
    ],
)
def test_bad_inputs_are_rejected_with_the_fix(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        thd_attention(*args, THD, **kwargs)


@pytest.mark.parametrize(
    ("group_size", "rank", "message"),
    [
        (None, None, "the THD batch is CP rank 0's shard of cp_size=2 but no cp_group was given; pass the"),
        (4, 0, "the THD batch is CP rank 0's shard of cp_size=2 but this process is rank 0 of a cp_group of 4"),
        (2, 1, "the THD batch is CP rank 0's shard of cp_size=2 but this process is rank 1 of a cp_group of 2"),
    ],
)
def test_a_cp_shard_needs_the_group_it_was_sharded_for(monkeypatch, group_size, rank, message):
    """One check (ThdMeta.check_cp_group), one message, for every way the group can disagree."""
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group: group_size)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group: rank)
    group = None if group_size is None else object()  # stands in for a ProcessGroup
    for shard in ({**make_thd([4, 8], 2), "cp_size": 2, "cp_rank": 0}, cp_shard(thd_collate([P5]), 2, 0)):
        with pytest.raises(ValueError, match=message):
            thd_attention(*_qkv(tokens=thd_meta(shard).local_tokens), shard, cp_group=group)


@pytest.mark.parametrize(
    ("make_group", "message"),
    [
        (
            lambda group: group,
            r"splits sequences over groups of \[2\] ranks, smaller than its CP group of 4, and a plain process group "
            r"has no sub-groups; pass the run's CpTopology as cp_group",
        ),
        (
            lambda group: CpTopology(dp_size=1, cp_size=4, rank=1, gpus_per_node=4, cp_group=group),
            r"made without placement groups, and CP ranks 0..1 need one; make it with placement_groups=True",
        ),
    ],
)
def test_a_placed_shard_split_over_pairs_needs_their_groups(monkeypatch, make_group, message):
    """Refused before any collective, on every rank alike (the placement is every rank's)."""
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group: 4)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group: 1)
    shard = cp_shard(placed_metadata(MIXED_PACKS[4]), 4, 1)
    for comm_type in ("p2p", "all_gather"):
        with pytest.raises(ValueError, match=message):
            thd_attention(
                *_qkv(tokens=thd_meta(shard).local_tokens), shard, cp_group=make_group(object()), backend="math",
                cp_comm_type=comm_type,
            )  # fmt: skip


def test_lengths_not_divisible_by_2cp_are_rejected():
    shard = {**make_thd([6, 6], 1), "cp_size": 2, "cp_rank": 0}
    with pytest.raises(ValueError, match=r"padded length 6, not a multiple of 2\*cp_size=4"):
        thd_attention(*_qkv(tokens=6), shard)


def test_the_keywords_are_a_shorthand_for_the_config():
    config = AttentionConfig(backend="math", causal=False, softmax_scale=0.5, cp_comm_type="all_gather")
    q, k, v = _qkv()
    out = thd_attention(q, k, v, THD, config=config)
    assert torch.equal(out, thd_attention(q, k, v, THD, **dataclasses.asdict(config)))
    assert torch.equal(out, thd_attention(q, k, v, THD, backend="math", causal=False, softmax_scale=0.5))
    assert not torch.equal(out, thd_attention(q, k, v, THD, config=AttentionConfig(backend="math")))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"config": AttentionConfig(backend="math"), "causal": False},
            r"got both config and the keywords \['causal'\]; pass one of them, e.g. "
            r"config=dataclasses.replace\(config, causal=...\)",
        ),
        ({"casual": False}, r"unexpected keyword arguments \['casual'\]; it takes config, cp_group, return_lse and"),
        ({"config": {"backend": "math"}}, "config must be a thdpack.attention.AttentionConfig, got dict"),
    ],
)
def test_config_and_keywords_misuse_is_rejected(kwargs, message):
    with pytest.raises(TypeError, match=message):
        thd_attention(*_qkv(), THD, **kwargs)


def _fake_flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale, causal, return_attn_probs):
    """flash-attn's varlen contract in plain torch: sequence i = rows cu[i]:cu[i+1] of each side;
    causal aligns the last query with the last key; returns (out, lse (Nq, Tq), None) with the LSE."""
    assert cu_q.dtype == cu_k.dtype == torch.int32 and isinstance(max_q, int) and isinstance(max_k, int)
    assert max_q >= int((cu_q[1:] - cu_q[:-1]).max()) and max_k >= int((cu_k[1:] - cu_k[:-1]).max())
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out, lse = torch.zeros_like(q), torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=q.dtype)
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for qa, qb, ka, kb in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:], strict=False):
        scores = torch.einsum("qnh,knh->nqk", q[qa:qb], k[ka:kb]) * softmax_scale
        if causal:
            rows, cols = torch.arange(qb - qa)[:, None], torch.arange(kb - ka)[None, :]
            scores = scores.masked_fill(cols > rows + (kb - ka) - (qb - qa), float("-inf"))
        lse[:, qa:qb] = scores.logsumexp(-1)
        out[qa:qb] = torch.einsum("nqk,knh->qnh", scores.softmax(-1).nan_to_num(), v[ka:kb])
    return (out, lse, None) if return_attn_probs else out


@pytest.mark.parametrize("causal", [True, False])
def test_the_flash_adapter_feeds_the_kernel_padded_queries_and_real_keys(monkeypatch, causal):
    # flash-attn needs CUDA; a plain-torch kernel with its contract checks the adapter around it
    monkeypatch.setitem(
        sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=_fake_flash_attn_varlen_func)
    )
    thd = make_thd([7, 1, 12], multiple=4, tail=4)
    case = random_case(thd, 4, 2, 8, torch.float64, seed=5)
    config = AttentionConfig(backend="flash", causal=causal)
    call = AttentionCall(thd=thd, meta=thd_meta(thd), config=config, scale=0.3, cp_group=None, return_lse=True)
    q, k, v = (case[name].clone().requires_grad_() for name in ("q", "k", "v"))
    out, lse = flash.attend(q, k, v, call)
    want_out, want_lse = reference_attention(case["q"], case["k"], case["v"], thd, causal=causal, softmax_scale=0.3)
    valid = case["valid"]
    assert torch.allclose(out[valid], want_out[valid], atol=1e-12)
    assert torch.allclose(lse[:, valid], want_lse[:, valid], atol=1e-12)
    with pytest.raises(RuntimeError, match="ignores the LSE's gradient"):
        lse[:, valid].sum().backward()
