"""FlashAttention-2 attention tiles on CUDA (fp16 / bf16), through PyTorch's built-in kernels.

The ring calls ``torch.ops.aten._flash_attention_forward`` / ``_backward`` directly, not
``varlen_attn``, because ``varlen_attn``'s autograd drops the LSE gradient and cannot take the
globally merged out / LSE the backward recomputation needs. Conventions handled here:
``cu_seqlens`` int32, LSE ``(Nq, Tq)`` fp32, an empty key set's ``lse = +inf`` (``-inf`` outside,
fed back as ``+inf`` so the backward computes ``P = 0``). Only real keys are fed to non-causal
tiles, since FlashAttention-2 cannot mask keys inside a sequence.

Legend: ``T`` rows, ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

import torch

from thdpack.attention.math_kernel import Tile
from thdpack.attention.merge import normalize_lse

HALF_DTYPES = (torch.float16, torch.bfloat16)


MIN_CAPABILITY = (8, 0)
"""FlashAttention-2 runs on Ampere (sm80) and newer; T4 (sm75) and V100 (sm70) abort."""
MAX_HEAD_DIM = 256


def unavailable_reason(
    device: torch.device,
    dtype: torch.dtype,
    *,
    capability: tuple[int, int] | None = None,
    head_dim: int | None = None,
    head_dim_v: int | None = None,
) -> str | None:
    """Why FlashAttention-2 kernels (flash-attn's, and PyTorch's own behind ``varlen_attn`` and the
    ring's tiles) cannot run here, or None when they can.

    The rules are FlashAttention-2's own checks (``flash_api.cpp``): CUDA fp16 / bf16, compute
    capability 8.0 or newer, one head dim for Q, K and V, a multiple of 8 and at most 256.
    ``capability`` / ``head_dim`` / ``head_dim_v`` left None are not checked.

    >>> unavailable_reason(torch.device("cuda"), torch.bfloat16, capability=(7, 5))
    'FlashAttention-2 kernels need compute capability 8.0 (Ampere) or newer, this GPU is sm75'
    >>> unavailable_reason(torch.device("cuda"), torch.bfloat16, head_dim=80, head_dim_v=64)
    'FlashAttention-2 kernels need V to have the head dim of Q and K (80), got 64'
    """
    if device.type != "cuda":
        return f"FlashAttention kernels need CUDA tensors, got device {device.type!r}"
    if dtype not in HALF_DTYPES:
        return f"FlashAttention kernels need float16 or bfloat16, got {dtype}"
    if capability is not None and tuple(capability) < MIN_CAPABILITY:
        major, minor = capability
        return f"FlashAttention-2 kernels need compute capability 8.0 (Ampere) or newer, this GPU is sm{major}{minor}"
    if head_dim is not None:
        if head_dim_v is not None and head_dim_v != head_dim:
            return f"FlashAttention-2 kernels need V to have the head dim of Q and K ({head_dim}), got {head_dim_v}"
        if head_dim % 8 or head_dim > MAX_HEAD_DIM:
            return f"FlashAttention-2 kernels need a head dim that is a multiple of 8 and at most 256, got {head_dim}"
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return f"torch {torch.__version__} has no aten._flash_attention_forward (needs torch >= 2.2)"
    return None


def _tile_lengths(tile: Tile) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor, int, int]]:
    """(key rows to keep or None, the kernels' ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)``)."""
    q, k = tile.q, tile.k
    if tile.causal or not k.has_padding:
        # causal: padding follows every real token, so no real query ever sees a padded key
        return None, (q.cu, k.cu, max(q.counts), max(k.counts))
    return k.valid_index, (q.cu, k.valid_cu, max(q.counts), max(k.valid_counts))


def tile_forward(
    q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor, tile: Tile
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`thdpack.attention.math_kernel.tile_forward`; out in q's dtype.

    ``tile.q`` and ``tile.k`` must have equal per-sequence row counts when ``tile.causal`` (square tiles).
    """
    keep, lengths = _tile_lengths(tile)
    if keep is not None:
        k_TNH, v_TNH = k_TNH.index_select(0, keep), v_TNH.index_select(0, keep)
    if lengths[3] == 0 or q_TNH.shape[0] == 0:
        out = q_TNH.new_zeros((q_TNH.shape[0], q_TNH.shape[1], v_TNH.shape[-1]))
        return out, q_TNH.new_full((q_TNH.shape[1], q_TNH.shape[0]), float("-inf"), dtype=torch.float32)
    out_TNH, lse_NT = torch.ops.aten._flash_attention_forward(
        q_TNH.contiguous(), k_TNH.contiguous(), v_TNH.contiguous(), *lengths, 0.0, tile.causal, False, scale=tile.scale
    )[:2]
    return out_TNH, normalize_lse(lse_NT)


def tile_backward(
    dout_TNH: torch.Tensor,
    q_TNH: torch.Tensor,
    k_TNH: torch.Tensor,
    v_TNH: torch.Tensor,
    out_TNH: torch.Tensor,
    lse_NT: torch.Tensor,
    tile: Tile,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tile gradients from the rows' GLOBAL ``out`` (q's dtype) and ``lse`` (fp32, -inf = empty).

    The kernel computes ``delta = rowsum(dout * out)`` itself, so this path cannot take a
    gradient of the LSE; callers use the math kernel when one arrives.
    """
    keep, lengths = _tile_lengths(tile)
    k_in, v_in = (k_TNH, v_TNH) if keep is None else (k_TNH.index_select(0, keep), v_TNH.index_select(0, keep))
    if lengths[3] == 0 or q_TNH.shape[0] == 0:
        return torch.zeros_like(q_TNH), torch.zeros_like(k_TNH), torch.zeros_like(v_TNH)
    rng_state = torch.zeros(2, dtype=getattr(torch, "uint64", torch.int64), device=q_TNH.device)
    unused = torch.empty(0, device=q_TNH.device)
    lse_for_kernel = lse_NT.float().masked_fill(torch.isneginf(lse_NT), float("inf")).contiguous()
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout_TNH.contiguous(), q_TNH.contiguous(), k_in.contiguous(), v_in.contiguous(), out_TNH.contiguous(),
        lse_for_kernel, *lengths, 0.0, tile.causal, rng_state, unused, scale=tile.scale,
    )  # fmt: skip
    if keep is not None:
        dk = torch.zeros_like(k_TNH).index_copy(0, keep, dk)
        dv = torch.zeros_like(v_TNH).index_copy(0, keep, dv)
    return dq, dk, dv
