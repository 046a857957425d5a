"""The oracle: every sequence attended alone, densely, with plain autograd.

``reference_attention`` is deliberately naive (one dense softmax per sequence, no tiling, no LSE
tricks, no sharding) so that it can be trusted by inspection; every thdpack backend, the ring and
the all-gather CP paths are tested against it. Run it in fp64 for exactness proofs.

Legend: ``T`` tokens (global, storage order), ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from thdpack.attention.config import resolve_softmax_scale
from thdpack.thd.carriage import thd_meta


def reference_attention(
    q_TNH: torch.Tensor,
    k_TNH: torch.Tensor,
    v_TNH: torch.Tensor,
    thd: Mapping[str, Any],
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence dense attention over a whole (unsharded) THD batch, differentiable.

    Args:
        q_TNH: (T, Nq, H) all tokens in storage order (``cu_seqlens_padded`` slots).
        k_TNH / v_TNH: (T, Nkv, H) / (T, Nkv, Hv), ``Nq % Nkv == 0``.
        thd: the batch, or any of its CP shards (``cu_seqlens``, ``cu_seqlens_padded``; the
            tensors are the global ones whatever the shard).
        causal: token i of a sequence sees tokens 0..i of it; otherwise all its real tokens.
        softmax_scale: default ``H ** -0.5``.

    Returns:
        ``out_TNH`` (T, Nq, Hv) and ``lse_NT`` (Nq, T) in q's dtype; padding rows are 0 / -inf.

    >>> q = torch.ones(4, 1, 2, dtype=torch.float64)
    >>> v = torch.arange(4.0, dtype=torch.float64).view(4, 1, 1)
    >>> thd = {"cu_seqlens": torch.tensor([0, 2, 3]), "cu_seqlens_padded": torch.tensor([0, 2, 4])}
    >>> out, lse = reference_attention(q, q, v, thd)
    >>> out.flatten().tolist()     # row 1 averages tokens 0 and 1; row 3 is padding
    [0.0, 0.5, 2.0, 0.0]
    """
    meta = thd_meta(thd).unsharded()
    scale = resolve_softmax_scale(softmax_scale, q_TNH.shape[-1])
    group = q_TNH.shape[1] // k_TNH.shape[1]
    outs, lses = [], []
    start = 0
    for n, slot in zip(meta.lengths, meta.lengths_padded, strict=True):
        q_NLH = q_TNH[start : start + n].transpose(0, 1)
        k_NLH = k_TNH[start : start + n].transpose(0, 1).repeat_interleave(group, 0)
        v_NLH = v_TNH[start : start + n].transpose(0, 1).repeat_interleave(group, 0)
        scores_NLL = q_NLH @ k_NLH.transpose(1, 2) * scale
        if causal:
            future = torch.ones(n, n, dtype=torch.bool, device=q_TNH.device).triu(1)
            scores_NLL = scores_NLL.masked_fill(future, float("-inf"))
        padding_NH = v_TNH.new_zeros(slot - n, q_TNH.shape[1], v_TNH.shape[-1])
        outs += [(torch.softmax(scores_NLL, -1) @ v_NLH).transpose(0, 1), padding_NH]
        lses += [torch.logsumexp(scores_NLL, -1), q_TNH.new_full((q_TNH.shape[1], slot - n), float("-inf"))]
        start += slot
    return torch.cat(outs), torch.cat(lses, dim=1)
