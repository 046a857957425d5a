"""The decoder's layers: RMSNorm, rotary embeddings from position ids, GQA attention over THD
batches, SwiGLU, and the pre-norm block.

Legend: ``T`` tokens on this rank (a whole THD batch, or one CP rank's shard of it), ``D`` model
dim, ``N`` heads (``Nq`` query, ``Nkv`` key/value), ``H`` head dim, ``F`` MLP hidden width.

Conventions follow Hugging Face's Llama (parameter names, RoPE's rotate-half channel pairing,
RMSNorm's cast back to the input dtype before the weight), so weights map one to one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from thdpack.attention.api import thd_attention
from thdpack.cp.topology import CpGroupLike
from thdpack.models.config import ModelConfig

_HALF = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision activations (norms and rotary angles need it), else ``dtype``."""
    return torch.float32 if dtype in _HALF else dtype


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x**2) + eps)``, normalised in fp32 for half-precision input."""

    def __init__(self, dim: int, eps: float, *, device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        x = x_TD.to(compute_dtype(x_TD.dtype))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(x_TD.dtype)


def rope_cos_sin(
    position_ids_T: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cosines and sines for each token's position.

    Args:
        position_ids_T: (T,) integer, each token's position INSIDE its sequence (a THD batch's
            ``position_ids``; on a CP shard the global position, which ``cp.shard`` keeps).
        head_dim: H, even.
        theta: RoPE base.
        dtype: activation dtype; angles are computed in fp32 (fp64 for fp64 activations).

    Returns:
        ``(cos_TH, sin_TH)``, (T, H) in ``compute_dtype(dtype)``; channel ``i`` and ``i + H/2``
        share a frequency (rotate-half pairing).
    """
    dtype = compute_dtype(dtype)
    device = position_ids_T.device
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim)
    angles_TH = position_ids_T.to(dtype)[:, None] * inv_freq[None, :]
    angles_TH = torch.cat((angles_TH, angles_TH), dim=-1)
    return angles_TH.cos(), angles_TH.sin()


def apply_rope(x_TNH: torch.Tensor, cos_TH: torch.Tensor, sin_TH: torch.Tensor) -> torch.Tensor:
    """Rotate every head of every token by its position's angles: (T, N, H) -> (T, N, H), x's dtype.

    A query at position ``i`` and a key at position ``j`` then score ``q R(j - i) k``: only the
    distance inside the sequence matters.
    """
    x1, x2 = x_TNH.chunk(2, dim=-1)
    rotated_TNH = torch.cat((-x2, x1), dim=-1)
    cos, sin = cos_TH.to(x_TNH.dtype)[:, None, :], sin_TH.to(x_TNH.dtype)[:, None, :]
    return x_TNH * cos + rotated_TNH * sin


@dataclass(frozen=True)
class LayerContext:
    """What every block reads besides its activations, the same for all blocks of one forward."""

    rope_TH: tuple[torch.Tensor, torch.Tensor]
    """``(cos_TH, sin_TH)`` of the tokens' positions (:func:`rope_cos_sin`)."""
    thd: Mapping[str, Any]
    """The batch's (or shard's) attention metadata, as ``thd_attention`` takes it."""
    cp_group: CpGroupLike | None
    """The CP topology or group of a shard, None without CP."""


class Attention(nn.Module):
    """Grouped-query self-attention of each packed sequence to itself, through ``thd_attention``."""

    def __init__(self, config: ModelConfig, *, device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        H = config.head_dim
        factory = {"device": device, "dtype": dtype, "bias": False}
        self.q_proj = nn.Linear(config.dim, config.n_heads * H, **factory)
        self.k_proj = nn.Linear(config.dim, config.n_kv_heads * H, **factory)
        self.v_proj = nn.Linear(config.dim, config.n_kv_heads * H, **factory)
        self.o_proj = nn.Linear(config.n_heads * H, config.dim, **factory)

    def forward(self, x_TD: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        cfg = self.config
        T, H = x_TD.shape[0], cfg.head_dim
        q_TNH = apply_rope(self.q_proj(x_TD).view(T, cfg.n_heads, H), *ctx.rope_TH)
        k_TNH = apply_rope(self.k_proj(x_TD).view(T, cfg.n_kv_heads, H), *ctx.rope_TH)
        v_TNH = self.v_proj(x_TD).view(T, cfg.n_kv_heads, H)
        out_TNH = thd_attention(q_TNH, k_TNH, v_TNH, ctx.thd, config=cfg.attention, cp_group=ctx.cp_group)
        return self.o_proj(out_TNH.reshape(T, cfg.n_heads * H))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: (T, D) -> (T, D) through (T, F)."""

    def __init__(self, config: ModelConfig, *, device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        factory = {"device": device, "dtype": dtype, "bias": False}
        self.gate_proj = nn.Linear(config.dim, config.ffn_dim, **factory)
        self.up_proj = nn.Linear(config.dim, config.ffn_dim, **factory)
        self.down_proj = nn.Linear(config.ffn_dim, config.dim, **factory)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_TD)) * self.up_proj(x_TD))


class DecoderBlock(nn.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, *, device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps, device=device, dtype=dtype)
        self.self_attn = Attention(config, device=device, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps, device=device, dtype=dtype)
        self.mlp = SwiGLU(config, device=device, dtype=dtype)

    def forward(self, x_TD: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        x_TD = x_TD + self.self_attn(self.input_layernorm(x_TD), ctx)
        return x_TD + self.mlp(self.post_attention_layernorm(x_TD))
