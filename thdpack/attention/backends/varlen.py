"""``varlen`` backend: ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10, CUDA fp16/bf16).

Its signature changed between releases, so it is detected: 2.10 takes ``is_causal``; 2.11+
``window_size=(-1, 0)`` and ``scale``; 2.12+ ``enable_gqa`` (before it K/V are repeated to the
query heads). The LSE (``return_aux``) is ``(Nq, T)`` fp32 whatever the 2.12 / 2.13 docstring
says, and the op's backward ignores its gradient, so a loss that uses it raises instead of
training wrongly. Under CP thdpack's ring with FlashAttention-2 tiles runs instead.

Legend: ``T`` tokens, ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

import thdpack._optional as _optional
from thdpack.attention.backends.base import AttentionBackend, AttentionCall, AttentionOutput, CallFacts, needs_cuda_half
from thdpack.attention.config import resolve_softmax_scale
from thdpack.attention.merge import no_lse_gradient, normalize_lse


@functools.cache
def _parameters() -> frozenset[str]:
    from torch.nn.attention import varlen

    return frozenset(inspect.signature(varlen.varlen_attn).parameters)


def kernel_problem(s: CallFacts) -> Exception | None:
    if not _optional.has_varlen_attn():
        return ImportError(
            f"backend 'varlen' needs torch.nn.attention.varlen (torch >= 2.10), not in torch "
            f"{torch.__version__}; upgrade torch, or use backend='flash' or 'math'"
        )
    return needs_cuda_half("varlen", s)


def attend(q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor, call: AttentionCall) -> AttentionOutput:
    """``(out (T, Nq, H), lse (Nq, T) fp32 or None)``; the LSE is not differentiable (guarded)."""
    from torch.nn.attention import varlen

    params = _parameters()
    kwargs: dict[str, Any] = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if call.causal else (-1, -1)
    else:
        kwargs["is_causal"] = call.causal
    if "scale" in params:
        kwargs["scale"] = call.scale
    elif call.scale != resolve_softmax_scale(None, q_TNH.shape[-1]):
        raise ValueError(
            f"torch {torch.__version__}'s varlen_attn has no scale argument, so softmax_scale={call.scale} "
            "cannot apply; use the default scale, backend='flash' / 'math', or torch >= 2.11"
        )
    group = q_TNH.shape[1] // k_TNH.shape[1]
    if group > 1:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k_TNH, v_TNH = k_TNH.repeat_interleave(group, 1), v_TNH.repeat_interleave(group, 1)
    if call.return_lse:
        kwargs["return_aux"] = varlen.AuxRequest(lse=True)
    k_TNH, v_TNH, cu_q, cu_k, max_q, max_k = call.varlen_operands(k_TNH, v_TNH)
    result = varlen.varlen_attn(q_TNH, k_TNH, v_TNH, cu_q, cu_k, max_q, max_k, **kwargs)
    if not call.return_lse:
        return result, None
    out_TNH, lse_NT = result
    return out_TNH, no_lse_gradient(normalize_lse(lse_NT), "torch varlen_attn")


BACKEND = AttentionBackend(
    name="varlen", cp={"p2p": "ring_flash", "a2a": "a2a"}, kernel_problem=kernel_problem, attend=attend
)
