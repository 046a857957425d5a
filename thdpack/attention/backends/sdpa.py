"""``sdpa`` backend: ``scaled_dot_product_attention`` with a dense (T, T) document mask.

The mask is :func:`thdpack.attention.masks.block_causal_mask`: same sequence, real key, and (causal) key
not after the query. It costs O(T^2) memory, and with a mask CUDA SDPA falls back from the flash
kernel to the efficient / math kernels, so this backend is for small packs and cross-checks. SDPA
returns no LSE. Padding rows see the real tokens of their sequence, so no row is empty. Under
context parallelism only with ``cp_comm_type="a2a"`` (the kernel on the whole batch the all-to-all
delivers, for ``Nq / cp`` heads).

Legend: ``T`` tokens, ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from thdpack.attention.backends.base import AttentionBackend, AttentionCall, AttentionOutput, CallFacts, to_1NTH, to_TNH
from thdpack.attention.masks import block_causal_mask


def kernel_problem(s: CallFacts) -> Exception | None:
    if s.need_lse:
        return ValueError(
            "backend 'sdpa' does not return the LSE (scaled_dot_product_attention has no such "
            "output); use backend='math' or 'flex'"
        )
    return None


def attend(q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor, call: AttentionCall) -> AttentionOutput:
    """``(out (T, Nq, Hv), None)`` for one device's tokens (the mask is built once per batch)."""
    device, causal = q_TNH.device, call.causal
    mask_TT = call.meta.cached(
        ("sdpa mask", causal, device), lambda: block_causal_mask(call.thd, causal=causal).to(device)
    )
    out_1NTH = F.scaled_dot_product_attention(
        *to_1NTH(q_TNH, k_TNH, v_TNH),
        attn_mask=mask_TT,
        scale=call.scale,
        enable_gqa=q_TNH.shape[1] != k_TNH.shape[1],
    )
    return to_TNH(out_1NTH), None


BACKEND = AttentionBackend(name="sdpa", cp={"a2a": "a2a"}, kernel_problem=kernel_problem, attend=attend)
