"""All-gather-KV context-parallel attention (Llama 3 style), exact, without TE.

Every rank gathers all ranks' K/V (with their own Nkv heads: cheap under GQA), puts them back in
storage order and attends its own load-balanced queries to them with the per-token mask; no LSE
merge is needed. The backward reduce-scatters dK/dV (fp32) back to their owners. Against the ring:
one collective instead of n overlapped hops, a full K/V buffer per rank, and an independent
implementation to check the ring with. Tiles use the math kernel.

Legend: ``T`` local tokens, ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from thdpack.attention.backends.math import tiled_attention
from thdpack.attention.math_kernel import Tile
from thdpack.cp.comm import all_gather_rows, reduce_scatter_rows
from thdpack.cp.partition import gather_order, local_placement
from thdpack.thd.meta import ThdMeta
from thdpack.thd.tokens import global_placement


class GatherKV(torch.autograd.Function):
    """Differentiable all-gather of K and V into global storage order (backward: reduce-scatter)."""

    @staticmethod
    def forward(
        ctx: Any,
        k_TNH: torch.Tensor,
        v_TNH: torch.Tensor,
        order: torch.Tensor,
        group: dist.ProcessGroup | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.order, ctx.group = order, group
        return (
            all_gather_rows(k_TNH, group).index_select(0, order),
            all_gather_rows(v_TNH, group).index_select(0, order),
        )

    @staticmethod
    def backward(ctx: Any, dk_TNH: torch.Tensor, dv_TNH: torch.Tensor) -> tuple[Any, ...]:
        grads = []
        for d in (dk_TNH, dv_TNH):
            stacked = torch.zeros_like(d, dtype=torch.promote_types(d.dtype, torch.float32))
            stacked.index_copy_(0, ctx.order, d.to(stacked.dtype))
            grads.append(reduce_scatter_rows(stacked, ctx.group).to(d.dtype))
        return grads[0], grads[1], None, None


def allgather_attention(
    q_TNH: torch.Tensor,
    k_TNH: torch.Tensor,
    v_TNH: torch.Tensor,
    meta: ThdMeta,
    *,
    cp_group: dist.ProcessGroup | None,
    causal: bool = True,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather-KV attention of this rank's shard (math tiles).

    Args:
        q_TNH, k_TNH, v_TNH: this rank's shard of q (T, Nq, H), k (T, Nkv, H) and v (T, Nkv, Hv),
            as ``thdpack.attention.ring_attention`` takes them.
        meta: the shard's record (``cp_size``, ``cp_rank``, the global lengths).
        cp_group: the CP process group (None: one rank).
        causal: causal attention inside each sequence.
        scale: the softmax scale.

    Returns:
        ``out_TNH`` (T, Nq, Hv) in q's dtype and ``lse_NT`` (Nq, T) of this rank's queries, as
        ``ring_attention``.
    """
    device = q_TNH.device
    order = gather_order(meta, device).gathered_of_global_T
    k_glob, v_glob = GatherKV.apply(k_TNH, v_TNH, order, cp_group)
    q_rows, kv_rows = local_placement(meta, device), global_placement(meta, device)
    return tiled_attention(q_TNH, k_glob, v_glob, Tile(q_rows, kv_rows, causal, scale))
