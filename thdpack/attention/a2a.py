"""All-to-all context-parallel attention (DeepSpeed Ulysses, ``cp_comm_type="a2a"``), exact, any kernel.

One all-to-all turns each rank's shard of every head into every token of the batch for ``N / W``
heads; the backend's local kernel attends whole sequences with the batch's global ``cu_seqlens``;
a second all-to-all returns the output to the shard::

    rank r: q (T_local, Nq, H) --all-to-all--> (T, Nq/W, H) --kernel--> (T, Nq/W, Hv) --all-to-all--> (T_local, Nq, Hv)

No sequence is cut into slivers and every rank does the same work whatever the lengths. The
exchange reads where each rank's rows sit in the batch (``rank_token_indices``), so TE's layout
and a per-sequence placement work alike. ``W`` must divide ``Nq``; KV heads are repeated where it
does not divide ``Nkv`` (``thdpack.attention.heads``).

Legend: ``T`` tokens of the whole batch, ``T_local`` of this rank, ``W`` ranks, ``N`` heads
(``Nq`` query, ``Nkv`` key/value), ``H`` head dim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from thdpack.attention.backends.base import AttendFn, AttentionCall, AttentionOutput
from thdpack.attention.config import AttentionConfig, resolve_softmax_scale
from thdpack.attention.heads import kv_replication, repeat_kv_heads
from thdpack.cp.comm import all_to_all_blocks
from thdpack.cp.partition import GatherOrder, gather_order
from thdpack.thd.carriage import attach_meta, thd_meta
from thdpack.thd.meta import ThdMeta


def a2a_bytes(
    local_tokens: int,
    cp_size: int,
    nq: int,
    nkv: int,
    head_dim: int,
    *,
    head_dim_v: int | None = None,
    itemsize: int = 2,
    backward: bool = True,
) -> int:
    """Bytes each rank receives per layer: forward Q, K, V in and O out, backward dO in and dQ, dK,
    dV out (the same shapes again). Each all-to-all keeps ``1/W`` of a rank's rows at home and
    receives ``(W-1)/W`` of them; K and V travel with their repeated heads (:func:`kv_replication`).
    ``itemsize``: bytes per element of q/k/v (2 for bf16); the LSE (``return_lse``) is not counted.

    >>> a2a_bytes(2048, 4, 32, 8, 128)   # Llama-3-8B attention, 8192 tokens over 4 ranks, bf16
    62914560
    """
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    kv_heads = nkv * kv_replication(nq, nkv, cp_size)
    per_token = nq * head_dim + kv_heads * (head_dim + head_dim_v) + nq * head_dim_v
    if backward:
        per_token *= 2
    return (cp_size - 1) * local_tokens * (per_token // cp_size) * itemsize


def _exchange(blocks_W: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """All-to-all of (W, T_local, X_i) blocks, block ``w`` to rank ``w``: one collective per dtype
    (the blocks of a dtype travel side by side in one buffer)."""
    received: list[Any] = [None] * len(blocks_W)
    for dtype in dict.fromkeys(b.dtype for b in blocks_W):
        members = [i for i, b in enumerate(blocks_W) if b.dtype == dtype]
        packed = torch.cat([blocks_W[i] for i in members], dim=-1)
        parts = all_to_all_blocks(packed, group).split([blocks_W[i].shape[-1] for i in members], dim=-1)
        for i, part in zip(members, parts, strict=True):
            received[i] = part
    return received


def _to_heads(
    tensors: Sequence[torch.Tensor], order: GatherOrder, group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """(T_local, N, H) shard rows with every head -> (T, N/W, H) every token with this rank's heads."""
    size = dist.get_world_size(group)
    # head block w (heads w*N/W .. (w+1)*N/W - 1) goes to rank w
    blocks = [t.reshape(t.shape[0], size, -1).transpose(0, 1) for t in tensors]
    out = []
    for t, got_W in zip(tensors, _exchange(blocks, group), strict=True):
        total, heads = size * t.shape[0], t.shape[1] // size
        rows = got_W.reshape(total, -1).index_select(0, order.gathered_of_global_T)  # rank-major -> global
        out.append(rows.view(total, heads, t.shape[2]))
    return out


def _to_sequence(
    tensors: Sequence[torch.Tensor], order: GatherOrder, group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """(T, n, H) every token with this rank's n heads -> (T_local, n*W, H) shard rows with every head."""
    size = dist.get_world_size(group)
    local = tensors[0].shape[0] // size
    # global -> rank-major: block w holds rank w's rows in its local order
    blocks = [
        t.reshape(t.shape[0], -1).index_select(0, order.global_of_gathered_T).view(size, local, -1) for t in tensors
    ]
    out = []
    for t, got_W in zip(tensors, _exchange(blocks, group), strict=True):
        heads, dim = t.shape[1], t.shape[2]
        out.append(got_W.reshape(size, local, heads, dim).transpose(0, 1).reshape(local, size * heads, dim))
    return out


class _AllToAll(torch.autograd.Function):
    """One of the two exchanges, differentiable: its gradient is the other exchange."""

    @staticmethod
    def forward(
        ctx: Any, to_heads: bool, order: GatherOrder, group: dist.ProcessGroup | None, *tensors: torch.Tensor
    ) -> Any:
        ctx.to_heads, ctx.order, ctx.group = to_heads, order, group
        return tuple((_to_heads if to_heads else _to_sequence)(tensors, order, group))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        back = _to_sequence if ctx.to_heads else _to_heads
        return (None, None, None, *back(grads, ctx.order, ctx.group))


def sequence_to_heads(
    tensors_TNH: Sequence[torch.Tensor], order: GatherOrder, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, ...]:
    """The first all-to-all, differentiable (its gradient is :func:`heads_to_sequence`'s exchange).

    Args:
        tensors_TNH: (T_local, N_i, H_i) this rank's rows in its local order, every head;
            ``N_i`` a multiple of the group's size ``W``; any float dtypes (one collective each).
        order: where every rank's rows sit in the batch (:func:`thdpack.cp.partition.gather_order`).
        group: the CP group (every rank calls together).

    Returns:
        (T, N_i / W, H_i) per tensor: every token of the batch in global order, with rank ``r``'s
        heads ``r*N_i/W .. (r+1)*N_i/W - 1``.
    """
    return _AllToAll.apply(True, order, group, *tensors_TNH)


def heads_to_sequence(
    tensors_TnH: Sequence[torch.Tensor], order: GatherOrder, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, ...]:
    """The second all-to-all, the inverse of :func:`sequence_to_heads`: (T, n_i, H_i) every token
    with this rank's heads -> (T_local, n_i * W, H_i) this rank's rows with every head."""
    return _AllToAll.apply(False, order, group, *tensors_TnH)


def a2a_attention(
    q_TNH: torch.Tensor,
    k_TNH: torch.Tensor,
    v_TNH: torch.Tensor,
    whole_thd: Mapping[str, Any],
    *,
    order: GatherOrder,
    cp_group: dist.ProcessGroup | None,
    kernel: AttendFn,
    config: AttentionConfig,
    return_lse: bool,
) -> AttentionOutput:
    """Ulysses attention of this rank's rows; call on every rank of ``cp_group`` together.

    Args:
        q_TNH: (T_local, Nq, H) this rank's queries in its local order; ``W`` divides ``Nq``.
        k_TNH / v_TNH: (T_local, Nkv, H) / (T_local, Nkv, Hv), ``Nq % Nkv == 0`` (KV heads are
            repeated where ``W`` does not divide ``Nkv``: :func:`kv_replication`).
        whole_thd: the WHOLE batch's metadata (``cu_seqlens``, ``cu_seqlens_padded``,
            ``max_seqlen``: the global ones a shard carries), as the kernel reads it (a record of
            ``cp_size`` 1: :func:`whole_batch`).
        order: where every rank's rows sit in the whole batch (:func:`gather_order` of the shard's
            record, or :func:`~thdpack.cp.partition.gather_order_of` any placement's index maps).
        cp_group: the context-parallel group (None: the default group), of size ``W``.
        kernel: the local kernel (a backend's ``attend``), run on whole sequences.
        config: causal and softmax scale (``config.softmax_scale``, default ``H ** -0.5``).
        return_lse: also exchange the kernel's LSE back.

    Returns:
        ``(out (T_local, Nq, Hv) in q's dtype, lse (Nq, T_local) or None)``; both differentiable
        where the kernel's are.
    """
    size = dist.get_world_size(cp_group)
    k_TNH, v_TNH = repeat_kv_heads(k_TNH, v_TNH, kv_replication(q_TNH.shape[1], k_TNH.shape[1], size))
    q_all, k_all, v_all = sequence_to_heads((q_TNH, k_TNH, v_TNH), order, cp_group)
    call = AttentionCall(
        thd=whole_thd,
        meta=thd_meta(whole_thd),
        config=config,
        scale=resolve_softmax_scale(config.softmax_scale, q_TNH.shape[-1]),
        cp_group=None,
        return_lse=return_lse,
    )
    out_all, lse_all = kernel(q_all, k_all, v_all, call)
    if not return_lse:
        return heads_to_sequence((out_all,), order, cp_group)[0], None
    assert lse_all is not None, "a kernel asked for the LSE returns it"
    out_TNH, lse_TN1 = heads_to_sequence((out_all, lse_all.T.unsqueeze(-1)), order, cp_group)
    return out_TNH, lse_TN1.squeeze(-1).T


def whole_batch(thd: Mapping[str, Any], meta: ThdMeta) -> dict[str, Any]:
    """The whole batch's metadata for a CP shard ``thd`` (``meta`` its record): the same global
    ``cu_seqlens`` / ``cu_seqlens_padded`` tensors and ``max_seqlen``, carrying the unsharded
    record (so kernels, masks and placements see one device's whole batch). Cached on ``meta``
    per device, so every layer shares it and the caches of its record.
    """
    cu_seqlens = thd["cu_seqlens"]

    def build() -> dict[str, Any]:
        whole = {key: thd[key] for key in ("cu_seqlens", "cu_seqlens_padded") if thd.get(key) is not None}
        whole["max_seqlen"] = meta.max_seqlen
        attach_meta(whole, meta.unsharded())
        return whole

    return meta.cached(("whole batch", cu_seqlens.device), build)


def a2a_attend(kernel: AttendFn) -> AttendFn:
    """The ``"a2a"`` CP algorithm around a backend's ``kernel``: :func:`a2a_attention` of a
    ``thd_attention`` call on a CP shard (its batch, record, group and config)."""

    def attend(q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor, call: AttentionCall) -> AttentionOutput:
        return a2a_attention(
            q_TNH, k_TNH, v_TNH, whole_batch(call.thd, call.meta), order=gather_order(call.meta, q_TNH.device),
            cp_group=call.cp_group, kernel=kernel, config=call.config, return_lse=call.return_lse,
        )  # fmt: skip

    return attend
