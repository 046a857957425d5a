"""``thd_attention``: exact attention over a THD batch or a CP shard of one, any backend.

Legend: ``T`` tokens on this rank, ``N`` heads (``Nq`` query, ``Nkv`` key/value), ``H`` head dim.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from thdpack.attention.backends import flash as flash_backend
from thdpack.attention.backends import flex as flex_backend
from thdpack.attention.backends import math as math_backend
from thdpack.attention.backends import sdpa as sdpa_backend
from thdpack.attention.backends import te as te_backend
from thdpack.attention.backends import varlen as varlen_backend
from thdpack.attention.config import AttentionConfig, Backend, CpCommType
from thdpack.attention.metadata import ThdMeta, thd_meta
from thdpack.attention.select import Situation, choose_backend, log_choice


@overload
def thd_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    thd: Mapping[str, Any],
    *,
    causal: bool = ...,
    backend: Backend = ...,
    cp_group: dist.ProcessGroup | None = ...,
    softmax_scale: float | None = ...,
    return_lse: Literal[False] = ...,
    cp_comm_type: CpCommType = ...,
) -> torch.Tensor: ...
@overload
def thd_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    thd: Mapping[str, Any],
    *,
    causal: bool = ...,
    backend: Backend = ...,
    cp_group: dist.ProcessGroup | None = ...,
    softmax_scale: float | None = ...,
    return_lse: Literal[True],
    cp_comm_type: CpCommType = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
def thd_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    thd: Mapping[str, Any],
    *,
    causal: bool = True,
    backend: Backend = "auto",
    cp_group: dist.ProcessGroup | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    cp_comm_type: CpCommType = "p2p",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of every sequence of a packed THD batch to itself only, exactly.

    Args:
        q: (T, Nq, H) queries of this rank's tokens, in storage order (``thdpack.to_thd``) or in
            ``thdpack.cp.shard`` order under context parallelism.
        k: (T, Nkv, H) keys; ``Nq % Nkv == 0`` (GQA: query head h uses KV head ``h // (Nq/Nkv)``).
        v: (T, Nkv, Hv) values. q, k, v share one device and one float dtype.
        thd: the batch's metadata: ``cu_seqlens`` ((N+1,) int32, GLOBAL real lengths, ``[0] == 0``,
            non-decreasing), ``cu_seqlens_padded`` ((N+1,) int32, GLOBAL storage slots, each slot
            >= its real length, a multiple of ``2*cp_size`` under CP, ``[-1] == T * cp_size``),
            ``max_seqlen`` (Python int >= the widest slot) and, on a CP shard, ``cp_size`` /
            ``cp_rank``. Validated once per batch (cached), so every layer can pass it.
        causal: decoder attention inside each sequence (``"padding_causal"``); False = every
            real token of the sequence is visible (``"padding"``).
        backend: ``"auto"`` (fastest available, logged on ``thdpack.attention``; the environment
            variable ``THDPACK_ATTENTION_BACKEND`` forces one) or one of ``"te"``, ``"flash"``,
            ``"varlen"``, ``"flex"``, ``"sdpa"``, ``"math"``.
        cp_group: the context-parallel group when q/k/v are a CP shard (size must equal
            ``thd["cp_size"]``). ``te`` does CP itself; ``flash`` / ``varlen`` run thdpack's
            ring with FlashAttention-2 tiles; ``math`` runs it with exact math tiles (CPU/gloo).
        softmax_scale: default ``H ** -0.5``.
        return_lse: also return the log-sum-exp (differentiable with ``math`` and the CP ring).
        cp_comm_type: ``"p2p"`` (ring) or ``"all_gather"`` (Llama 3 style; math tiles or TE).

    Returns:
        ``out`` (T, Nq, Hv) in q's dtype, and with ``return_lse`` the ``lse`` (Nq, T), natural
        log, fp32 (fp64 for fp64 inputs).

    Padding: real tokens precede the padding of their slot. Causal attention over padded slots is
    therefore exact for every real token without any key mask (a real token never sees a later
    one); non-causal attention masks padded keys (the real ``cu_seqlens`` for kernels, the
    real-token flags for math / masks). Rows of padding tokens hold finite values that no real
    token depends on; the loss must ignore them (labels -100), as ``thdpack`` batches do.

    >>> thd = {"cu_seqlens": torch.tensor([0, 2, 3], dtype=torch.int32),
    ...        "cu_seqlens_padded": torch.tensor([0, 2, 4], dtype=torch.int32), "max_seqlen": 2}
    >>> x = torch.ones(4, 1, 2)
    >>> v = torch.arange(4.0).view(4, 1, 1)
    >>> thd_attention(x, x, v, thd, backend="math").flatten().tolist()  # token 1 averages 0 and 1
    [0.0, 0.5, 2.0, 2.0]
    """
    config = AttentionConfig(backend=backend, causal=causal, softmax_scale=softmax_scale, cp_comm_type=cp_comm_type)
    _check_qkv(q, k, v)
    meta = thd_meta(thd)
    cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
    _check_layout(q, meta, cp_group, cp_size)
    scale = q.shape[-1] ** -0.5 if config.softmax_scale is None else config.softmax_scale
    situation = Situation(
        device=q.device,
        dtype=q.dtype,
        cp=cp_size > 1,
        cp_comm_type=config.cp_comm_type,
        need_lse=return_lse,
        need_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
    )
    chosen, reason = choose_backend(config.backend, situation)
    log_choice(chosen, reason, situation)
    out, lse = _dispatch(chosen, q, k, v, thd, meta, config, scale, cp_group if cp_size > 1 else None, return_lse)
    return (out, lse) if return_lse else out


def _dispatch(
    backend: Backend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    thd: Mapping[str, Any],
    meta: ThdMeta,
    config: AttentionConfig,
    scale: float,
    cp_group: dist.ProcessGroup | None,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    causal = config.causal
    if backend == "te":
        out = te_backend.attend(
            q,
            k,
            v,
            thd,
            meta,
            causal=causal,
            scale=scale,
            cp_group=cp_group,
            cp_comm_type=config.cp_comm_type,
        )
        return out, None
    if cp_group is not None:
        # imported here: thdpack.attention.ring imports this package's kernels
        from thdpack.attention.allgather import allgather_attention
        from thdpack.attention.ring import ring_attention

        if config.cp_comm_type == "all_gather":
            return allgather_attention(q, k, v, meta, cp_group=cp_group, causal=causal, scale=scale)
        kernel = "flash" if backend in ("flash", "varlen") else "math"
        return ring_attention(q, k, v, meta, cp_group=cp_group, causal=causal, scale=scale, kernel=kernel)
    if backend == "math":
        return math_backend.attend(q, k, v, meta.local_side(q.device), causal=causal, scale=scale)
    if backend == "flash":
        return flash_backend.attend(q, k, v, thd, meta, causal=causal, scale=scale, return_lse=return_lse)
    if backend == "varlen":
        return varlen_backend.attend(q, k, v, thd, meta, causal=causal, scale=scale, return_lse=return_lse)
    if backend == "flex":
        return flex_backend.attend(q, k, v, thd, meta, causal=causal, scale=scale, return_lse=return_lse)
    if backend == "sdpa":
        return sdpa_backend.attend(q, k, v, thd, meta, causal=causal, scale=scale), None
    raise AssertionError(f"unhandled backend {backend!r}")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be (tokens, heads, head_dim), got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"q, k, v must have the same number of tokens, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same number of heads, got {k.shape[1]} and {v.shape[1]}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of k/v's {k.shape[1]}; GQA needs Nq % Nkv == 0")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[2]} and {k.shape[2]}")


def _check_layout(q: torch.Tensor, meta: ThdMeta, cp_group: dist.ProcessGroup | None, cp_size: int) -> None:
    if cp_size != meta.cp_size:
        where = "cp_group is None" if cp_group is None else f"cp_group has {cp_size} ranks"
        raise ValueError(
            f"thd is sharded for cp_size={meta.cp_size} but {where}; pass the context-parallel group the "
            "batch was sharded for (or the unsharded batch)"
        )
    if cp_size > 1 and dist.get_rank(cp_group) != meta.cp_rank:
        raise ValueError(
            f"thd is the shard of cp_rank={meta.cp_rank} but this process is rank {dist.get_rank(cp_group)} "
            "of cp_group; shard with thdpack.cp.shard(batch, cp_size, rank_in_cp_group)"
        )
    if q.shape[0] != meta.local_tokens:
        raise ValueError(
            f"q has {q.shape[0]} tokens but the THD metadata describes {meta.local_tokens} on this rank "
            f"(cu_seqlens_padded[-1]={meta.total_tokens} / cp_size={meta.cp_size})"
        )
