"""``sdpa`` backend: ``scaled_dot_product_attention`` with a dense (T, T) document mask.

The mask is :func:`thdpack.attention.masks.block_causal_mask`: same sequence, real key, and (causal) key
not after the query. It costs O(T^2) memory, and with a mask CUDA SDPA falls back from the flash
kernel to the efficient / math kernels, so this backend is for small packs and cross-checks. SDPA
returns no LSE. Padding rows see the real tokens of their sequence, so no row is empty.

Legend: ``T`` tokens, ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from thdpack.attention.masks import block_causal_mask
from thdpack.attention.metadata import ThdMeta


def attend(
    q_TNH: torch.Tensor,
    k_TNH: torch.Tensor,
    v_TNH: torch.Tensor,
    thd: Mapping[str, Any],
    meta: ThdMeta,
    *,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """(T, Nq, Hv) attention output of one device's tokens (the mask is built once per batch)."""
    device = q_TNH.device
    mask_TT = meta.cached(("sdpa mask", causal, device), lambda: block_causal_mask(thd, causal=causal).to(device))
    out_1NTH = F.scaled_dot_product_attention(
        q_TNH.transpose(0, 1).unsqueeze(0),
        k_TNH.transpose(0, 1).unsqueeze(0),
        v_TNH.transpose(0, 1).unsqueeze(0),
        attn_mask=mask_TT,
        scale=scale,
        enable_gqa=q_TNH.shape[1] != k_TNH.shape[1],
    )
    return out_1NTH[0].transpose(0, 1)
