"""``thdpack.attention.heads``: the head rules of an all-to-all CP exchange, in one process: which
KV heads travel, and that each rank's share of the heads is GQA on its own (the exchange itself
runs on gloo: tests/distributed/test_cp_a2a.py)."""

from __future__ import annotations

import pytest
import torch
from _attention_cases import make_thd, random_case

from thdpack.attention import reference_attention
from thdpack.attention.heads import kv_replication, repeat_kv_heads


@pytest.mark.parametrize(
    ("nq", "nkv", "cp_size", "copies"),
    [
        (32, 8, 2, 1),
        (32, 8, 8, 1),
        (32, 8, 16, 2),  # Llama-3-8B at cp 16
        (4, 1, 4, 4),  # MQA
        (4, 2, 4, 2),
        (12, 6, 4, 2),  # neither divides the other: lcm(6, 4) = 12 KV heads
        (6, 6, 3, 1),
    ],
)
def test_kv_heads_are_repeated_until_cp_divides_them(nq, nkv, cp_size, copies):
    assert kv_replication(nq, nkv, cp_size) == copies
    assert (nkv * copies) % cp_size == 0 and nq % (nkv * copies) == 0


@pytest.mark.parametrize(("nq", "nkv", "cp_size"), [(12, 4, 8), (6, 2, 4), (4, 4, 3)])
def test_query_heads_cp_does_not_divide_are_refused(nq, nkv, cp_size):
    with pytest.raises(ValueError, match=rf"cp_size={cp_size} ranks Nq / cp_size query heads, but q has Nq={nq} heads"):
        kv_replication(nq, nkv, cp_size)


@pytest.mark.parametrize(("nq", "nkv", "cp_size"), [(4, 1, 4), (4, 2, 4), (12, 6, 4), (8, 2, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_each_ranks_block_of_heads_attends_as_the_whole_model(nq, nkv, cp_size, causal):
    """Rank r's query heads r*Nq/cp.. with its block of the repeated KV heads give exactly those
    heads of the full GQA attention, and the repeated heads' gradients add up to K's and V's."""
    thd = make_thd([5, 9, 1], tail=3)
    case = random_case(thd, nq, nkv, 8, torch.float64, seed=nq + nkv + cp_size)
    q, k, v = (case[n].clone().requires_grad_() for n in ("q", "k", "v"))
    out, lse = reference_attention(q, k, v, thd, causal=causal)
    want = torch.autograd.grad((out * case["dout"]).sum(), (q, k, v))
    k_rep, v_rep = repeat_kv_heads(k, v, kv_replication(nq, nkv, cp_size))
    nq_rank, nkv_rank = nq // cp_size, k_rep.shape[1] // cp_size
    parts = []
    for r in range(cp_size):
        heads, kv_heads = slice(r * nq_rank, (r + 1) * nq_rank), slice(r * nkv_rank, (r + 1) * nkv_rank)
        part, part_lse = reference_attention(q[:, heads], k_rep[:, kv_heads], v_rep[:, kv_heads], thd, causal=causal)
        assert torch.equal(part_lse, lse[heads])
        parts.append(part)
    got_out = torch.cat(parts, dim=1)
    assert torch.allclose(got_out, out, atol=1e-12, rtol=0)
    got = torch.autograd.grad((got_out * case["dout"]).sum(), (q, k, v))
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert torch.allclose(g, w, atol=1e-12, rtol=0), name


def test_repeating_is_a_no_op_when_cp_divides_the_kv_heads():
    k, v = torch.randn(3, 4, 2), torch.randn(3, 4, 2)
    assert repeat_kv_heads(k, v, 1) == (k, v)
    k2, _ = repeat_kv_heads(k, v, 2)
    assert torch.equal(k2[:, 0::2], k) and torch.equal(k2[:, 1::2], k)
