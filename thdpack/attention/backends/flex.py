"""``flex`` backend: FlexAttention with a block-sparse document mask (:func:`thdpack.attention.masks.flex_block_mask`).

On CUDA the fused Triton kernel is used (``torch.compile(flex_attention)``, compiled once per
shape); on CPU the eager path materialises the scores and has no backward in torch >= 2.11, so
the selector only offers it there for forward-only calls. The LSE comes from
``return_aux=AuxRequest(lse=True)`` (``return_lse=True`` on older torch), natural log, and is
differentiable (FlexAttention's backward takes its gradient).

Legend: ``T`` tokens, ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from thdpack.attention.masks import flex_block_mask
from thdpack.attention.merge import normalize_lse
from thdpack.attention.metadata import ThdMeta


@functools.cache
def _kernel(compiled: bool) -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if compiled else flex_attention


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
    """``(out (T, Nq, Hv), lse (Nq, T) fp32 or None)``; the BlockMask is built once per batch."""
    from torch.nn.attention import flex_attention as flex_module

    device = q_TNH.device
    block_mask = meta.cached(("flex mask", causal, device), lambda: flex_block_mask(thd, causal=causal).to(device))
    kwargs: dict[str, Any] = {"block_mask": block_mask, "scale": scale, "enable_gqa": q_TNH.shape[1] != k_TNH.shape[1]}
    if return_lse:
        if "return_aux" in inspect.signature(flex_module.flex_attention).parameters:
            kwargs["return_aux"] = flex_module.AuxRequest(lse=True)
        else:
            kwargs["return_lse"] = True
    with warnings.catch_warnings():
        # the CPU path is deliberately unfused; torch warns about it on every call
        warnings.filterwarnings("ignore", message=".*unfused implementation.*")
        result = _kernel(q_TNH.is_cuda)(
            q_TNH.transpose(0, 1).unsqueeze(0),
            k_TNH.transpose(0, 1).unsqueeze(0),
            v_TNH.transpose(0, 1).unsqueeze(0),
            **kwargs,
        )
    if not return_lse:
        return result[0].transpose(0, 1), None
    out_1NTH, aux = result
    lse_1NT = aux.lse if hasattr(aux, "lse") else aux
    return out_1NTH[0].transpose(0, 1), normalize_lse(lse_1NT[0].float())
