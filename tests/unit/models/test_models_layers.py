"""Decoder layers: RMSNorm, RoPE (written-out values, rotation, relative positions), GQA
attention against a dense per-sequence computation, SwiGLU."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from thdpack.attention import AttentionConfig
from thdpack.models import ModelConfig
from thdpack.models.layers import Attention, LayerContext, RMSNorm, SwiGLU, apply_rope, rope_cos_sin


def test_rmsnorm_formula_and_half_precision():
    norm = RMSNorm(4, eps=1e-6, dtype=torch.float64)
    norm.weight.data = torch.tensor([1.0, 2.0, 0.5, -1.0], dtype=torch.float64)
    x = torch.tensor([[3.0, 4.0, 0.0, 0.0]], dtype=torch.float64)
    rms = math.sqrt((9 + 16) / 4 + 1e-6)
    torch.testing.assert_close(norm(x), torch.tensor([[3 / rms, 8 / rms, 0.0, 0.0]], dtype=torch.float64))
    # bf16 input: normalised in fp32, rounded once, then scaled (Hugging Face Llama's order)
    half = RMSNorm(4, eps=1e-6, dtype=torch.bfloat16)
    xb = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).bfloat16()
    want = (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert half(xb).dtype == torch.bfloat16
    assert torch.equal(half(xb), want)


def test_rope_written_out():
    cos, sin = rope_cos_sin(torch.tensor([0, 1, 2]), head_dim=4, theta=100.0, dtype=torch.float64)
    # frequencies 100 ** (-0/4) = 1 and 100 ** (-2/4) = 0.1, each used by channel i and i + 2
    angles = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 0.1, 1.0, 0.1], [2.0, 0.2, 2.0, 0.2]], dtype=torch.float64)
    torch.testing.assert_close(cos, angles.cos())
    torch.testing.assert_close(sin, angles.sin())
    # channel pair (0, 2) at position 1 rotates (1, 0) to (cos 1, sin 1): rotate-half convention
    x = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]], dtype=torch.float64)
    out = apply_rope(x, cos[1:2], sin[1:2])
    torch.testing.assert_close(out[0, 0], torch.tensor([math.cos(1), 0.0, math.sin(1), 0.0], dtype=torch.float64))


def test_rope_angles_in_fp32_for_bf16():
    cos, _ = rope_cos_sin(torch.arange(5), head_dim=8, theta=10000.0, dtype=torch.bfloat16)
    assert cos.dtype == torch.float32
    x = torch.ones(5, 2, 8, dtype=torch.bfloat16)
    assert apply_rope(x, cos, cos).dtype == torch.bfloat16


@given(
    i=st.integers(0, 500),
    j=st.integers(0, 500),
    shift=st.integers(0, 5000),
    seed=st.integers(0, 2**16),
)
def test_rope_scores_depend_only_on_the_distance(i, j, shift, seed):
    """Why positions must be right INSIDE a sequence but a per-sequence offset is harmless."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, 2, 16, generator=gen, dtype=torch.float64)

    def score(pi: int, pj: int) -> torch.Tensor:
        cos, sin = rope_cos_sin(torch.tensor([pi, pj]), 16, 10000.0, torch.float64)
        qr = apply_rope(q, cos[:1], sin[:1])
        kr = apply_rope(k, cos[1:], sin[1:])
        return (qr * kr).sum(-1)

    torch.testing.assert_close(score(i, j), score(i + shift, j + shift), rtol=0, atol=1e-10)
    cos, sin = rope_cos_sin(torch.tensor([i]), 16, 10000.0, torch.float64)
    torch.testing.assert_close(apply_rope(q, cos, sin).norm(dim=-1), q.norm(dim=-1))  # a rotation


@pytest.mark.parametrize(("causal", "scale"), [(True, None), (False, 0.3)])
def test_attention_equals_dense_gqa_per_sequence_with_the_configured_attention(causal, scale):
    # 4 query heads share 2 KV heads; every field of config.attention reaches thd_attention
    attention = AttentionConfig(backend="math", causal=causal, softmax_scale=scale)
    config = ModelConfig.preset("tiny", attention=attention)
    attn = Attention(config, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    for p in attn.parameters():
        p.data = torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.2
    lengths = [5, 3]
    x = torch.randn(sum(lengths), config.dim, generator=gen, dtype=torch.float64)
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    thd = {"cu_seqlens": cu, "cu_seqlens_padded": cu, "max_seqlen": 5}
    rope = rope_cos_sin(position_ids, config.head_dim, config.rope_theta, torch.float64)
    out = attn(x, LayerContext(rope, thd, None))

    H = config.head_dim
    for start, n in ((0, 5), (5, 3)):
        xs = x[start : start + n]
        cos, sin = rope_cos_sin(torch.arange(n), H, config.rope_theta, torch.float64)
        q = apply_rope(attn.q_proj(xs).view(n, 4, H), cos, sin).transpose(0, 1)
        k = apply_rope(attn.k_proj(xs).view(n, 2, H), cos, sin).repeat_interleave(2, 1).transpose(0, 1)
        v = attn.v_proj(xs).view(n, 2, H).repeat_interleave(2, 1).transpose(0, 1)
        dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        want = attn.o_proj(dense.transpose(0, 1).reshape(n, 4 * H))
        torch.testing.assert_close(out[start : start + n], want, rtol=0, atol=1e-12)


def test_swiglu_formula():
    mlp = SwiGLU(ModelConfig.preset("tiny"), dtype=torch.float64)
    x = torch.randn(3, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    gate, up = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
    want = (gate * torch.sigmoid(gate) * up) @ mlp.down_proj.weight.T
    torch.testing.assert_close(mlp(x), want)
