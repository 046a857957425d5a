"""``flash`` backend: flash-attn's ``flash_attn_varlen_func`` (CUDA, fp16 / bf16), one device.

A thin adapter, true to flash-attn's API (research/ring_attention.md section 3): q/k/v
``(T, N, H)``, int32 ``cu_seqlens``, Python-int ``max_seqlen``, GQA when ``Nq % Nkv == 0``,
``return_attn_probs=True`` for the ``(Nq, T)`` fp32 LSE (flash-attn >= 2.6).

Padding: causal attention runs over the padded slots (``cu_seqlens_padded``) and is exact for the
real tokens, which precede their slot's padding and so never see it. Non-causal attention feeds
only the real keys (with the real ``cu_seqlens``), because the kernel cannot mask keys inside a
sequence; padded query rows then see the real keys of their sequence.

Under context parallelism ``thd_attention`` runs thdpack's ring with PyTorch's built-in
FlashAttention-2 tiles instead (:mod:`thdpack.attention.flash_kernel`).

Legend: ``T`` tokens, ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from thdpack._optional import require
from thdpack.attention.merge import no_lse_gradient, normalize_lse
from thdpack.attention.metadata import ThdMeta, kernel_cu_seqlens


def attend(
    q_TNH: torch.Tensor,
    k_TNH: torch.Tensor,
    v_TNH: torch.Tensor,
    thd: Mapping[str, Any],
    meta: ThdMeta,
    *,
    causal: bool,
    scale: float,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out (T, Nq, H), lse (Nq, T) fp32 or None)``; the LSE is not differentiable (guarded)."""
    flash_attn = require("flash_attn", "the 'flash' attention backend")
    cu_q = kernel_cu_seqlens(thd, "cu_seqlens_padded", "flash", q_TNH.device)
    if causal or not meta.has_padding:
        cu_k, max_k = cu_q, meta.max_seqlen
    else:
        keep = meta.local_side(q_TNH.device).valid_index
        k_TNH, v_TNH = k_TNH.index_select(0, keep), v_TNH.index_select(0, keep)
        cu_k, max_k = kernel_cu_seqlens(thd, "cu_seqlens", "flash", q_TNH.device), max(meta.lengths)
    result = flash_attn.flash_attn_varlen_func(
        q_TNH,
        k_TNH,
        v_TNH,
        cu_q,
        cu_k,
        meta.max_seqlen,
        max_k,
        softmax_scale=scale,
        causal=causal,
        return_attn_probs=return_lse,
    )
    if not return_lse:
        return result, None
    out_TNH, lse_NT = result[0], result[1]
    return out_TNH, no_lse_gradient(normalize_lse(lse_NT), "flash_attn_varlen_func")
