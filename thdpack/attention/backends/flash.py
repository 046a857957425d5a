"""``flash`` backend: flash-attn's ``flash_attn_varlen_func`` (CUDA, fp16 / bf16), one device.

A thin adapter to flash-attn's API: ``(T, N, H)`` q/k/v, int32 ``cu_seqlens``, Python-int
``max_seqlen``, GQA, ``return_attn_probs=True`` for the ``(Nq, T)`` fp32 LSE (flash-attn >= 2.6).
Under CP thdpack's ring runs with PyTorch's own FlashAttention-2 tiles, so flash-attn is not
needed there; with ``cp_comm_type="a2a"`` this kernel runs on the whole sequences.

Legend: ``T`` tokens, ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

import torch

import thdpack._optional as _optional
from thdpack.attention.backends.base import AttentionBackend, AttentionCall, AttentionOutput, CallFacts, needs_cuda_half
from thdpack.attention.merge import no_lse_gradient, normalize_lse


def kernel_problem(s: CallFacts) -> Exception | None:
    if not _optional.has_flash_attn():
        return ImportError(
            "backend 'flash' needs flash-attn (flash_attn_varlen_func), which is not installed; "
            "pip install 'thdpack[flash]', or use backend='varlen' (torch >= 2.10) or 'math'"
        )
    version = _optional.flash_attn_version()
    if version is not None and version < _optional.FLASH_ATTN_SINCE:
        found = ".".join(map(str, version))
        return ImportError(
            f"backend 'flash' needs flash-attn >= 2.6, found {found}, whose flash_attn_varlen_func returns the LSE "
            "padded per sequence, (S, Nq, max_seqlen), not (Nq, T); pip install 'flash-attn>=2.6', or use "
            "backend='varlen' (torch >= 2.10) or 'math'"
        )
    return needs_cuda_half("flash", s)


def attend(q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor, call: AttentionCall) -> AttentionOutput:
    """``(out (T, Nq, H), lse (Nq, T) fp32 or None)``; the LSE is not differentiable (guarded)."""
    flash_attn = _optional.require("flash_attn", "the 'flash' attention backend")
    k_TNH, v_TNH, cu_q, cu_k, max_q, max_k = call.varlen_operands(k_TNH, v_TNH)
    result = flash_attn.flash_attn_varlen_func(
        q_TNH, k_TNH, v_TNH, cu_q, cu_k, max_q, max_k,
        softmax_scale=call.scale, causal=call.causal, return_attn_probs=call.return_lse,
    )  # fmt: skip
    if not call.return_lse:
        return result, None
    out_TNH, lse_NT = result[0], result[1]
    return out_TNH, no_lse_gradient(normalize_lse(lse_NT), "flash_attn_varlen_func")


BACKEND = AttentionBackend(
    name="flash", cp={"p2p": "ring_flash", "a2a": "a2a"}, kernel_problem=kernel_problem, attend=attend
)
