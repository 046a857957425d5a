"""``flex`` backend: FlexAttention with a block-sparse document mask (:func:`thdpack.attention.masks.flex_block_mask`).

On CUDA the fused Triton kernel is used (``torch.compile(flex_attention)``, compiled once per
shape); on CPU the eager path materialises the scores and has no backward in torch >= 2.11, so
it is only offered there for forward-only calls. The LSE comes from
``return_aux=AuxRequest(lse=True)`` (``return_lse=True`` on older torch), natural log, and is
differentiable (FlexAttention's backward takes its gradient). Under context parallelism only with
``cp_comm_type="a2a"`` (the kernel on the whole sequences the all-to-all delivers).

Legend: ``T`` tokens, ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch

import thdpack._optional as _optional
from thdpack.attention.backends.base import AttentionBackend, AttentionCall, AttentionOutput, CallFacts, to_1NTH, to_TNH
from thdpack.attention.masks import flex_block_mask
from thdpack.attention.merge import normalize_lse


def _torch_at_least(major: int, minor: int) -> bool:
    found = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return found >= (major, minor)


def kernel_problem(s: CallFacts) -> Exception | None:
    if not _optional.has_flex_attention():
        return ImportError(
            f"backend 'flex' needs torch.nn.attention.flex_attention (torch >= 2.5), not in torch "
            f"{torch.__version__}; use backend='math'"
        )
    if s.device.type == "cpu" and s.need_grad and _torch_at_least(2, 11):
        return ValueError(
            "backend 'flex' has no backward on CPU (torch >= 2.11 raises NotImplementedError); "
            "use backend='math' (exact, with backward) or run without gradients"
        )
    return None


@functools.cache
def _kernel(compiled: bool) -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if compiled else flex_attention


def attend(q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor, call: AttentionCall) -> AttentionOutput:
    """``(out (T, Nq, Hv), lse (Nq, T) fp32 or None)``; the BlockMask is built once per batch."""
    from torch.nn.attention import flex_attention as flex_module

    device, causal = q_TNH.device, call.causal
    block_mask = call.meta.cached(
        ("flex mask", causal, device), lambda: flex_block_mask(call.thd, causal=causal).to(device)
    )
    kwargs: dict[str, Any] = {
        "block_mask": block_mask,
        "scale": call.scale,
        "enable_gqa": q_TNH.shape[1] != k_TNH.shape[1],
    }
    if call.return_lse:
        if "return_aux" in inspect.signature(flex_module.flex_attention).parameters:
            kwargs["return_aux"] = flex_module.AuxRequest(lse=True)
        else:
            kwargs["return_lse"] = True
    with warnings.catch_warnings():
        # the CPU path is deliberately unfused; torch warns about it on every call
        warnings.filterwarnings("ignore", message=".*unfused implementation.*")
        result = _kernel(q_TNH.is_cuda)(*to_1NTH(q_TNH, k_TNH, v_TNH), **kwargs)
    if not call.return_lse:
        return to_TNH(result), None
    out_1NTH, aux = result
    lse_1NT = aux.lse if hasattr(aux, "lse") else aux
    return to_TNH(out_1NTH), normalize_lse(lse_1NT[0].float())


BACKEND = AttentionBackend(name="flex", cp={"a2a": "a2a"}, kernel_problem=kernel_problem, attend=attend)
