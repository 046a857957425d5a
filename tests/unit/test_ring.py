"""The ring algorithm in one process (ranks as threads): exact against the oracle, for any layout.

The real multi-process runs are in tests/distributed/test_cp_attention.py; these cover many more
length mixes cheaply, the tile schedule, gradcheck through the ring and the mutation checks.
"""

from __future__ import annotations

import pytest
import torch
from _attention_cases import (
    LENGTH_MIXES,
    make_thd,
    max_errors,
    random_case,
    reference_results,
    run_ring_threads,
    shard_of,
    simulate_ring,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from thdpack.attention import math_kernel
from thdpack.attention.metadata import thd_meta
from thdpack.cp import ring


def _worst(results, want, valid):
    worst: dict[str, float] = {}
    for index, got in results:
        for name, err in max_errors(got, want, index, valid).items():
            worst[name] = max(worst.get(name, 0.0), err)
    return worst


def test_tile_schedule_is_transformer_engines():
    # by KV source rank (nemo_te_spec.md 2.5): src == r diagonal, src < r lower (front kv), src > r upper
    expected = {"d": ("all", "all", True), "l": ("all", "front", False), "u": ("back", "all", False)}
    table = ["duuu", "lduu", "lldu", "llld"]  # rows: rank; columns: source rank of the K/V block
    for rank, row in enumerate(table):
        for step in range(4):
            src = (rank - step) % 4
            assert ring.tile_sections(step, rank, True) == expected[row[src]], (rank, step)
            assert ring.tile_sections(step, rank, False) == ("all", "all", False)


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("mix", sorted(LENGTH_MIXES))
def test_ring_matches_reference(cp_size, mix):
    lengths = LENGTH_MIXES[mix](2 * cp_size)
    for causal, (nq, nkv), tail in ((True, (4, 2), 0), (False, (4, 4), 2 * cp_size)):
        thd = make_thd(lengths, cp_size, tail=tail)
        case = random_case(thd, nq, nkv, 8, torch.float64, seed=cp_size)
        worst = _worst(simulate_ring(case, thd, cp_size, causal), reference_results(case, thd, causal), case["valid"])
        assert max(worst.values()) <= 1e-10, (mix, causal, worst)


@settings(max_examples=25)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=5),
    cp_size=st.integers(2, 4),
    causal=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_ring_matches_reference_for_any_lengths(lengths, cp_size, causal, seed):
    thd = make_thd(lengths, cp_size)
    case = random_case(thd, 2, 1, 4, torch.float64, seed)
    worst = _worst(simulate_ring(case, thd, cp_size, causal), reference_results(case, thd, causal), case["valid"])
    assert max(worst.values()) <= 1e-10, worst


def test_ring_fp32_within_1e5():
    thd = make_thd([40, 3, 17, 64], 4)
    case = random_case(thd, 4, 2, 16, torch.float32, seed=9)
    for causal in (True, False):
        worst = _worst(simulate_ring(case, thd, 4, causal), reference_results(case, thd, causal), case["valid"])
        assert max(worst.values()) <= 1e-5, worst


def test_padded_keys_get_no_gradient():
    thd = make_thd([1, 5], 2, tail=4)
    case = random_case(thd, 2, 2, 4, torch.float64, seed=4)
    for _, got in simulate_ring(case, thd, 2, causal=False):
        assert got["dk"].abs().sum() > 0
    for index, got in simulate_ring(case, thd, 2, causal=True):
        padding = ~case["valid"][index]
        assert got["dk"][padding].eq(0).all() and got["dv"][padding].eq(0).all()


_RIGHT_SECTIONS = ring.tile_sections


def _wrong_upper_sections(step, rank, causal):
    q_rows, kv_rows, tile_causal = _RIGHT_SECTIONS(step, rank, causal)
    return ("all", "front", False) if (q_rows, kv_rows) == ("back", "all") else (q_rows, kv_rows, tile_causal)


def test_a_wrong_tile_schedule_is_detected(monkeypatch):
    thd = make_thd([16, 9, 24], 2)
    case = random_case(thd, 2, 2, 8, torch.float64, seed=1)
    want = reference_results(case, thd, True)
    monkeypatch.setattr(ring, "tile_sections", _wrong_upper_sections)
    worst = _worst(simulate_ring(case, thd, 2, True), want, case["valid"])
    assert worst["out"] > 1e-2, worst  # the check discriminates


def test_a_shifted_partition_is_detected():
    thd = make_thd([16, 9, 24], 2)
    case = random_case(thd, 2, 2, 8, torch.float64, seed=1)
    want = reference_results(case, thd, True)
    results = simulate_ring(case, thd, 2, True)
    # what a rank would compare against had its shard been built for the other rank
    shifted = [(shard_of(thd, 2, 1 - r)[1], got) for r, (_, got) in enumerate(results)]
    assert max(_worst(shifted, want, case["valid"]).values()) > 1e-2


class _SimulatedRing(torch.autograd.Function):
    """All ranks of a thread ring as one differentiable function of the GLOBAL q, k, v."""

    @staticmethod
    def forward(ctx, q, k, v, thd, cp_size, causal):
        shards = [shard_of(thd, cp_size, r) for r in range(cp_size)]
        metas = [thd_meta(s) for s, _ in shards]
        scale = q.shape[-1] ** -0.5

        def fwd_rank(rk):
            idx = shards[rk.rank][1]
            return ring.ring_forward(
                rk, q[idx], k[idx], v[idx], metas[rk.rank], causal=causal, scale=scale, kernel="math"
            )

        parts = run_ring_threads(cp_size, fwd_rank)
        out, lse = torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0], dtype=q.dtype)
        for (_, idx), (o, l) in zip(shards, parts, strict=True):
            out[idx], lse[:, idx] = o, l
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.shards, ctx.metas, ctx.cp_size, ctx.causal, ctx.scale = shards, metas, cp_size, causal, scale
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors

        def bwd_rank(rk):
            idx = ctx.shards[rk.rank][1]
            delta = math_kernel.softmax_delta(dout[idx], out[idx], dlse[:, idx])
            return ring.ring_backward(
                rk, dout[idx], q[idx], k[idx], v[idx], out[idx], lse[:, idx], delta, ctx.metas[rk.rank],
                causal=ctx.causal, scale=ctx.scale, kernel="math",
            )  # fmt: skip

        grads = [torch.zeros_like(t) for t in (q, k, v)]
        for (_, idx), parts in zip(ctx.shards, run_ring_threads(ctx.cp_size, bwd_rank), strict=True):
            for total, part in zip(grads, parts, strict=True):
                total[idx] = part
        return *grads, None, None, None


@pytest.mark.parametrize("cp_size", [2, 3])
def test_gradcheck_through_a_simulated_ring(cp_size):
    thd = make_thd([2 * cp_size, 3], cp_size)  # second sequence padded
    total = int(thd["cu_seqlens_padded"][-1])
    g = torch.Generator().manual_seed(cp_size)
    q = torch.randn(total, 2, 3, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(total, 1, 3, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(total, 1, 3, dtype=torch.float64, generator=g, requires_grad=True)
    for causal in (True, False):

        def fn(q, k, v, causal=causal):
            return _SimulatedRing.apply(q, k, v, thd, cp_size, causal)

        assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)
