"""CUDA kernels: FlashAttention-2 tiles vs math tiles, the bf16 ring on one GPU, varlen / flash / TE.

The issue's GPU criterion: in bf16, no worse than 2x plain PyTorch bf16 attention's error against
an fp32 reference. Skipped without CUDA (the CPU/gloo suite is the gate).
"""

from __future__ import annotations

import pytest
import torch

import thdpack._optional as _optional
from thdpack.attention import flash_kernel, math_kernel, reference_attention, thd_attention
from thdpack.attention.math_kernel import Tile
from thdpack.attention.merge import output_grads
from thdpack.attention.ring_simulation import simulated_ring_attention
from thdpack.attention.select import ENV_VAR
from thdpack.cp.partition import local_placement
from thdpack.thd.carriage import thd_meta

from support.attention_cases import make_thd, missing_library, random_case
from support.placement_cases import MIXED_PACKS, placed_metadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: FlashAttention-2 tiles, varlen_attn, TE"),
]
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def _cuda_case(thd, nq, nkv, head_dim, seed):
    case = random_case(thd, nq, nkv, head_dim, torch.float32, seed)
    return {name: t.to(CUDA) for name, t in case.items()}, {
        k: (v.to(CUDA) if torch.is_tensor(v) else v) for k, v in thd.items()
    }


def _grads(attend, q, k, v, dout):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves)
    out.backward(dout.to(out.dtype))
    return {"out": out.detach().float(), **{n: t.grad.float() for n, t in zip(("dq", "dk", "dv"), leaves, strict=True)}}


def _errors_and_plain_bf16_errors(case, thd, causal, attend):
    """``attend``'s errors in bf16 and plain PyTorch's (the reference run in bf16), both against fp32."""
    qkv = [case[name] for name in ("q", "k", "v")]

    def reference(q, k, v):
        return reference_attention(q, k, v, thd, causal=causal)[0]

    want = _grads(reference, *qkv, case["dout"])
    bf16 = [t.bfloat16() for t in qkv]
    errors = _errors(_grads(attend, *bf16, case["dout"]), want, case["valid"])
    return errors, _errors(_grads(reference, *bf16, case["dout"]), want, case["valid"])


def _errors(got, want, valid):
    return {name: float((got[name] - want[name])[valid].abs().max()) for name in want}


@pytest.mark.parametrize("causal", [True, False])
def test_flash_tiles_match_math_tiles(causal):
    thd = make_thd([16, 3, 40, 9], 2)
    for rank in range(2):
        meta = thd_meta({**thd, "cp_size": 2, "cp_rank": rank})
        mine, other = local_placement(meta, CUDA, rank), local_placement(meta, CUDA, 1 - rank)
        tiles = [(mine, mine, causal)]
        if causal:
            tiles += [(mine, other.half(back=False), False), (mine.half(back=True), other, False)]
        g = torch.Generator(device=CUDA).manual_seed(rank)
        for q_side, k_side, tile_causal in tiles:
            q = torch.randn(q_side.num_rows, 4, 64, device=CUDA, generator=g, dtype=torch.bfloat16)
            k, v = (
                torch.randn(k_side.num_rows, 2, 64, device=CUDA, generator=g, dtype=torch.bfloat16) for _ in range(2)
            )
            tile = Tile(q_side, k_side, tile_causal, 0.125)
            out_f, lse_f = flash_kernel.tile_forward(q, k, v, tile)
            out_m, lse_m = math_kernel.tile_forward(q, k, v, tile)
            assert torch.allclose(out_f.float(), out_m, atol=2e-2)
            assert torch.equal(torch.isneginf(lse_f), torch.isneginf(lse_m))  # +inf sentinel normalised
            finite = torch.isfinite(lse_m)
            assert torch.allclose(lse_f[finite], lse_m[finite], atol=1e-3)
            dout = torch.randn_like(q)
            delta = output_grads(dout, out_m, None, q.dtype).delta_NT
            grads_f = flash_kernel.tile_backward(dout, q, k, v, out_m.to(q.dtype), lse_m, tile)
            grads_m = math_kernel.tile_backward(dout, q, k, v, lse_m, delta, tile)
            for got, want in zip(grads_f, grads_m, strict=True):
                assert torch.allclose(got.float(), want, atol=5e-2)


def test_an_empty_key_set_gives_zero_output_and_minus_inf_lse():
    i32 = torch.int32
    thd = {"cu_seqlens": torch.tensor([0, 0, 8], dtype=i32), "cu_seqlens_padded": torch.tensor([0, 8, 16], dtype=i32)}
    side = local_placement(thd_meta(thd), CUDA)  # the first slot holds padding only
    q = torch.randn(16, 2, 64, device=CUDA, dtype=torch.bfloat16)
    out, lse = flash_kernel.tile_forward(q, q, q, Tile(side, side, False, 0.125))
    assert out[:8].eq(0).all() and torch.isneginf(lse[:, :8]).all() and torch.isfinite(lse[:, 8:]).all()


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_bf16_ring_on_flash_tiles_is_within_2x_plain_bf16_error(cp_size, causal):
    n = cp_size
    thd = make_thd([2 * n, 16 * n, 128 * n, 6 * n - 3], cp_size)
    case, thd = _cuda_case(thd, 4, 2, 64, seed=cp_size)

    def ring(q, k, v):
        return simulated_ring_attention(q, k, v, thd, cp_size=cp_size, causal=causal, kernel="flash")[0]

    ring_errors, plain = _errors_and_plain_bf16_errors(case, thd, causal, ring)
    for name, err in ring_errors.items():
        assert err <= 2 * plain[name], (name, ring_errors, plain)


@pytest.mark.parametrize("backend", ["varlen", "flash", "te", "flex", "sdpa", "math"])
@pytest.mark.parametrize("causal", [True, False])
def test_backends_are_within_2x_plain_bf16_error(backend, causal):
    if reason := missing_library(backend):
        pytest.skip(reason)
    thd = make_thd([5, 1, 170, 64, 33], multiple=8, tail=8)
    case, thd = _cuda_case(thd, 8, 2, 64, seed=3)

    def attend(q, k, v):
        return thd_attention(q, k, v, thd, causal=causal, backend=backend)

    got, plain = _errors_and_plain_bf16_errors(case, thd, causal, attend)
    for name, err in got.items():
        assert err <= 2 * plain[name], (backend, name, got, plain)


def test_varlen_lse_layout_and_its_gradient_guard():
    if reason := missing_library("varlen"):
        pytest.skip(reason)
    thd = make_thd([7, 12], multiple=4)
    case, thd = _cuda_case(thd, 4, 4, 64, seed=5)
    q, k, v = (case[name].bfloat16().requires_grad_() for name in ("q", "k", "v"))
    _, lse = thd_attention(q, k, v, thd, backend="varlen", return_lse=True)
    _, want_lse = reference_attention(*(case[name] for name in ("q", "k", "v")), thd)
    valid = case["valid"]
    assert lse.shape == (4, len(valid)) and lse.dtype == torch.float32
    assert torch.allclose(lse[:, valid], want_lse[:, valid], atol=2e-2)
    with pytest.raises(RuntimeError, match="ignores the LSE's gradient"):
        lse[:, valid].sum().backward()


@pytest.mark.parametrize("backend", ["varlen", "flash", "te", "flex", "sdpa", "math"])
def test_backends_run_a_placed_batch_with_empty_padding_entries(backend):
    """The whole part of a placed shard is a batch with padding entries of no real token (and
    empty slots left out): every kernel runs it within 2x plain bf16 error (one GPU, no CP)."""
    if reason := missing_library(backend):
        pytest.skip(reason)
    thd = placed_metadata(MIXED_PACKS[4])
    case, thd = _cuda_case(thd, 8, 2, 64, seed=4)
    assert thd_meta(thd).groups is not None  # moved with the batch

    def attend(q, k, v):
        return thd_attention(q, k, v, thd, backend=backend)

    got, plain = _errors_and_plain_bf16_errors(case, thd, True, attend)
    for name, err in got.items():
        assert err <= 2 * plain[name], (backend, name, got, plain)


@pytest.mark.parametrize("backend", ["flash", "flex"])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_and_flex_return_the_lse_on_cuda(backend, causal):
    """Issue 26: the LSE of ``flash`` (flash-attn's ``return_attn_probs``) and of ``flex`` on CUDA
    (``AuxRequest(lse=True)``) had no test: (Nq, T) fp32, natural log, the oracle's on real rows."""
    if backend == "flash" and not _optional.has_flash_attn():
        pytest.skip("flash-attn is not installed (pip install 'thdpack[flash]')")
    thd = make_thd([5, 1, 170, 64, 33], multiple=8, tail=8)
    case, thd = _cuda_case(thd, 8, 2, 64, seed=6)
    q, k, v = (case[name].bfloat16() for name in ("q", "k", "v"))
    with torch.no_grad():
        out, lse = thd_attention(q, k, v, thd, causal=causal, backend=backend, return_lse=True)
        want_out, want_lse = reference_attention(*(case[name] for name in ("q", "k", "v")), thd, causal=causal)
        plain_out, plain_lse = reference_attention(q, k, v, thd, causal=causal)  # plain PyTorch in bf16
    valid = case["valid"]
    assert lse.shape == (8, len(valid)) and lse.dtype == torch.float32
    errors = {
        "lse": (
            float((lse - want_lse)[:, valid].abs().max()),
            float((plain_lse.float() - want_lse)[:, valid].abs().max()),
        ),
        "out": (
            float((out.float() - want_out)[valid].abs().max()),
            float((plain_out.float() - want_out)[valid].abs().max()),
        ),
    }
    for name, (err, plain) in errors.items():
        assert err <= 2 * plain + 1e-3, (backend, name, errors)
