"""The math tile kernel and the ``math`` backend against the per-sequence dense oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thdpack.attention import math_kernel
from thdpack.attention.backends.math import attend as attend_math
from thdpack.attention.backends.math import tiled_attention
from thdpack.attention.math_kernel import Tile
from thdpack.attention.merge import merge_partials, output_grads
from thdpack.cp.partition import local_placement
from thdpack.thd.carriage import thd_meta
from thdpack.thd.tokens import TokenPlacement

from support.attention_cases import autograd_results, global_errors, make_thd, random_case, reference_results

CPU = torch.device("cpu")
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def _math_results(case, thd, causal, *, with_dlse=True):
    side = local_placement(thd_meta(thd), CPU)

    def attend(q, k, v):
        return attend_math(q, k, v, side, causal=causal, scale=q.shape[-1] ** -0.5)

    return autograd_results(case, attend, with_dlse=with_dlse)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("nq", "nkv"), [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("multiple", [1, 8])  # 8: slots padded, tail padding too
def test_math_backend_matches_reference(dtype, causal, nq, nkv, multiple):
    thd = make_thd([5, 1, 17, 8, 2], multiple=multiple, tail=8 if multiple > 1 else 0)
    case = random_case(thd, nq, nkv, 8, dtype, seed=nq * 10 + nkv)
    got = _math_results(case, thd, causal)
    errors = global_errors(got, reference_results(case, thd, causal), case["valid"])
    assert max(errors.values()) <= TOL[dtype], errors
    assert got["out"].dtype == dtype and got["lse"].dtype == dtype  # fp32 LSE for fp32, fp64 for fp64


@settings(max_examples=30)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    multiple=st.sampled_from([1, 2, 8]),
    causal=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_math_backend_matches_reference_for_any_lengths(lengths, multiple, causal, seed):
    thd = make_thd(lengths, multiple=multiple)
    case = random_case(thd, 4, 2, 4, torch.float64, seed)
    errors = global_errors(_math_results(case, thd, causal), reference_results(case, thd, causal), case["valid"])
    assert max(errors.values()) <= 1e-10, errors


def _key_tiles(meta, cuts_per_seq):
    """Key tiles: tile j holds positions [cuts[j], cuts[j+1]) of every sequence."""
    tiles = []
    starts = [0, *torch.cumsum(torch.tensor(meta.lengths_padded), 0).tolist()]
    for j in range(len(cuts_per_seq[0]) - 1):
        rows, counts, valid, pos = [], [], [], []
        for i, cuts in enumerate(cuts_per_seq):
            lo, hi = cuts[j], cuts[j + 1]
            rows.append(torch.arange(starts[i] + lo, starts[i] + hi))
            pos.append(torch.arange(lo, hi))
            counts.append(hi - lo)
            valid.append(min(max(meta.lengths[i] - lo, 0), hi - lo))
        tiles.append((torch.cat(rows), TokenPlacement(tuple(counts), tuple(valid), torch.cat(pos))))
    return tiles


@pytest.mark.parametrize("causal", [True, False])
def test_tile_gradients_with_the_global_lse_sum_to_the_full_gradient(causal):
    thd = make_thd([13, 6, 9], multiple=4)
    meta = thd_meta(thd)
    case = random_case(thd, 4, 2, 8, torch.float64, seed=3)
    g = torch.Generator().manual_seed(0)
    cuts = []
    for slot in meta.lengths_padded:
        inner = sorted(torch.randint(0, slot + 1, (2,), generator=g).tolist())
        cuts.append([0, *inner, slot])  # three tiles per sequence, some possibly empty
    q_side, scale = local_placement(meta, CPU), 8**-0.5
    out = torch.zeros(case["q"].shape, dtype=torch.float64)
    lse = torch.full((4, len(case["valid"])), float("-inf"), dtype=torch.float64)
    tiles = _key_tiles(meta, cuts)
    for rows, k_side in tiles:
        part = math_kernel.tile_forward(case["q"], case["k"][rows], case["v"][rows], Tile(q_side, k_side, causal, scale))
        out, lse = merge_partials(out, lse, *part)
    want = reference_results(case, thd, causal)
    valid = case["valid"]
    assert torch.allclose(out[valid], want["out"][valid], atol=1e-12)
    assert torch.allclose(lse[:, valid], want["lse"][:, valid], atol=1e-12)

    dlse = case["dlse"].masked_fill(~valid, 0.0)  # a nonzero LSE gradient enters through delta
    grads = output_grads(case["dout"], out, dlse, case["q"].dtype)
    delta = grads.delta_NT
    assert grads.dout_TNH is case["dout"] and grads.dlse_NT is dlse
    dq, dk, dv = torch.zeros_like(out), torch.zeros_like(case["k"]), torch.zeros_like(case["v"])
    for rows, k_side in tiles:
        dq_t, dk_t, dv_t = math_kernel.tile_backward(
            case["dout"], case["q"], case["k"][rows], case["v"][rows], lse, delta, Tile(q_side, k_side, causal, scale)
        )
        dq += dq_t
        dk.index_add_(0, rows, dk_t)
        dv.index_add_(0, rows, dv_t)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.allclose(got, want[name], atol=1e-12), name


@given(
    q_counts=st.lists(st.integers(0, 30), min_size=1, max_size=8),
    heads=st.integers(1, 4),
    budget=st.integers(1, 3000),
)
def test_blocks_cover_each_sequence_once_within_the_budget(q_counts, heads, budget):
    k_counts = [(3 * n) % 31 for n in q_counts]
    q = TokenPlacement(tuple(q_counts), tuple(q_counts), torch.zeros(sum(q_counts), dtype=torch.int64))
    k = TokenPlacement(tuple(k_counts), tuple(k_counts), torch.zeros(sum(k_counts), dtype=torch.int64))
    covered = torch.zeros(sum(q_counts), sum(k_counts), dtype=torch.int64)
    for qa, qb, ka, kb in math_kernel.plan_blocks(q, k, heads, budget):
        assert qb > qa and kb > ka
        assert heads * (qb - qa) * (kb - ka) <= budget or qb - qa == 1  # a single row may exceed
        covered[qa:qb, ka:kb] += 1
    same_seq = q.seg_T[:, None] == k.seg_T[None, :]
    assert covered[same_seq].eq(1).all()  # every pair of one sequence exactly once
    assert covered.le(1).all()


@given(counts=st.lists(st.integers(0, 30), min_size=1, max_size=8), budget=st.integers(1, 3000))
def test_causal_self_blocks_cover_every_visible_pair(counts, budget):
    side = TokenPlacement(tuple(counts), tuple(counts), torch.zeros(sum(counts), dtype=torch.int64))
    covered = torch.zeros(sum(counts), sum(counts), dtype=torch.int64)
    for qa, qb, ka, kb in math_kernel.plan_blocks(side, side, 2, budget, causal_self=True):
        covered[qa:qb, ka:kb] += 1
    rows = torch.arange(sum(counts))
    visible = (side.seg_T[:, None] == side.seg_T[None, :]) & (rows[:, None] >= rows[None, :])
    assert covered[visible].eq(1).all() and covered.le(1).all()


def test_small_blocks_give_the_same_result(monkeypatch):
    thd = make_thd([70, 3, 40], multiple=4)
    case = random_case(thd, 2, 2, 4, torch.float64, seed=5)
    full = _math_results(case, thd, True)
    monkeypatch.setattr(math_kernel, "_SCORE_BUDGET", 97)  # forces many row blocks per sequence
    split = _math_results(case, thd, True)
    for name in full:
        assert torch.allclose(full[name], split[name], atol=1e-13), name


def test_gradcheck_fp64():
    thd = make_thd([3, 5], multiple=4)
    side = local_placement(thd_meta(thd), CPU)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(12, 2, 3, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(12, 1, 3, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(12, 1, 2, dtype=torch.float64, generator=g, requires_grad=True)  # Hv != H
    for causal in (True, False):

        def fn(q, k, v, causal=causal):
            out, lse = tiled_attention(q, k, v, Tile(side, side, causal, 0.7))
            return out, lse.masked_fill(torch.isinf(lse), 0.0)

        assert torch.autograd.gradcheck(fn, (q, k, v))


def test_views_and_shared_storage_are_accepted():
    thd = make_thd([6, 10])
    side = local_placement(thd_meta(thd), CPU)
    qkv = torch.randn(16, 3, 4, 8, dtype=torch.float64, requires_grad=True)  # packed (T, 3, N, H)
    q, k, v = qkv.unbind(1)
    out, _ = attend_math(q, k, v, side, causal=True, scale=0.3)
    out.sum().backward()
    contiguous = [t.detach().contiguous() for t in (q, k, v)]
    want, _ = attend_math(*contiguous, side, causal=True, scale=0.3)
    assert torch.equal(out, want)
    assert qkv.grad is not None and qkv.grad.abs().sum() > 0


def test_repeated_runs_are_bitwise_equal():
    thd = make_thd([9, 4, 30], multiple=4)
    case = random_case(thd, 4, 2, 8, torch.float32, seed=2)
    first, second = _math_results(case, thd, True), _math_results(case, thd, True)
    assert all(torch.equal(first[n], second[n]) for n in first)


def test_bf16_inputs_accumulate_in_fp32():
    thd = make_thd([9, 4, 30], multiple=4)
    case = random_case(thd, 4, 2, 8, torch.bfloat16, seed=2)
    side = local_placement(thd_meta(thd), CPU)
    out, lse = attend_math(case["q"], case["k"], case["v"], side, causal=True, scale=8**-0.5)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want = reference_results(case, thd, True)
    valid = case["valid"]
    assert (out.double() - want["out"])[valid].abs().max() < 2e-2  # bf16 output rounding
    assert (lse.double() - want["lse"])[:, valid].abs().max() < 1e-5  # fp32 from bf16 inputs


def test_the_padding_key_mask_matters_only_without_causality():
    thd = make_thd([5, 2, 9], multiple=8)
    meta = thd_meta(thd)
    case = random_case(thd, 2, 2, 8, torch.float64, seed=6)
    masked = local_placement(meta, CPU)
    unmasked = TokenPlacement(masked.counts, masked.counts, masked.pos_T)  # padding treated as real keys
    valid = case["valid"]
    for causal in (True, False):
        with_mask, _ = attend_math(case["q"], case["k"], case["v"], masked, causal=causal, scale=0.3)
        without, _ = attend_math(case["q"], case["k"], case["v"], unmasked, causal=causal, scale=0.3)
        same = torch.allclose(with_mask[valid], without[valid], atol=1e-13)
        assert same == causal  # causal: a real token never sees its slot's later padding


def test_gradients_flow_to_whichever_inputs_require_them():
    thd = make_thd([6, 10])
    side = local_placement(thd_meta(thd), CPU)
    q = torch.randn(16, 2, 4, dtype=torch.float64, requires_grad=True)
    k, v = torch.randn(16, 2, 4, dtype=torch.float64), torch.randn(16, 2, 4, dtype=torch.float64)
    out, _ = attend_math(q, k, v, side, causal=True, scale=0.5)
    (dq,) = torch.autograd.grad(out.sum(), (q,))
    assert dq.shape == q.shape and dq.abs().sum() > 0
