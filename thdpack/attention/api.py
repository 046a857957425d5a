"""``thd_attention``: exact attention over a THD batch or a CP shard of one, any backend.

Legend: ``T`` tokens on this rank, ``S`` sequences, ``N`` heads (``Nq`` query, ``Nkv`` key/value),
``H`` head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from thdpack.attention.backends.base import AttentionCall, CallFacts
from thdpack.attention.config import AttentionConfig, resolve_softmax_scale
from thdpack.attention.select import attend_function, choose_backend, log_choice
from thdpack.cp.topology import CpGroupLike, CpTopology
from thdpack.thd.carriage import thd_meta

CONFIG_KEYWORDS = tuple(f.name for f in dataclasses.fields(AttentionConfig))
"""The keywords ``thd_attention`` accepts as a shorthand for ``config=AttentionConfig(...)``."""


@overload
def thd_attention(*args: Any, return_lse: Literal[False] = ..., **kwargs: Any) -> torch.Tensor: ...
@overload
def thd_attention(*args: Any, return_lse: Literal[True], **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]: ...
def thd_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    thd: Mapping[str, Any],
    *,
    config: AttentionConfig | None = None,
    cp_group: CpGroupLike | None = None,
    return_lse: bool = False,
    **keywords: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of every sequence of a packed THD batch to itself only, exactly.

    Args:
        q: (T, Nq, H) queries of this rank's tokens, in storage order (``thdpack.to_thd``) or in
            ``thdpack.cp.shard`` order under context parallelism.
        k: (T, Nkv, H) keys; ``Nq % Nkv == 0`` (GQA: query head h uses KV head ``h // (Nq/Nkv)``).
        v: (T, Nkv, Hv) values. q, k, v share one device and one float dtype.
        thd: the batch's metadata: ``cu_seqlens`` ((S+1,) int32, GLOBAL real lengths, ``[0] == 0``,
            non-decreasing), ``cu_seqlens_padded`` ((S+1,) int32, GLOBAL storage slots, each at
            least its real length, a multiple of ``2*cp_size`` under CP, ``[-1] == T * cp_size``),
            ``max_seqlen`` (Python int >= the widest slot); on a CP shard the record
            ``thdpack.cp.shard`` gives it (or ``cp_size`` / ``cp_rank`` keys). A batch thdpack
            made carries its validated record; any other is validated by the first call, which
            stores the record in it (``thdpack.thd.meta``), so every layer can pass it. A shard
            of a per-sequence CP placement (``cp_placement="adaptive"``; its record says) runs
            its split sequences through the CP algorithm within their group of ranks and its
            whole sequences through the backend's kernel, communicating nothing for them
            (:mod:`thdpack.attention.placed`); a batch whose packs a ``cp_placement="auto"`` plan
            attends by all-to-all (its record's ``groups.all_to_all``) runs ``cp_comm_type="a2a"``
            whatever ``config`` says (exact either way: only the speed differs).
        config: how to attend (:class:`~thdpack.attention.AttentionConfig`): ``backend``
            (``"auto"`` = fastest available, logged on ``thdpack.attention``; the environment
            variable ``THDPACK_ATTENTION_BACKEND`` forces one), ``causal``, ``softmax_scale``
            (default ``H ** -0.5``) and ``cp_comm_type`` (``"p2p"`` ring, ``"all_gather"`` or
            ``"a2a"``: all-to-all to whole sequences for ``Nq / cp`` heads, any backend's kernel).
            Default: ``AttentionConfig()``.
        cp_group: when q/k/v are a CP shard, the run's :class:`~thdpack.cp.topology.CpTopology`
            (its CP group, and the placement groups a per-sequence placement splits sequences
            over), or a plain process group: the CP group the batch was sharded for (its size
            and this process's rank in it are the shard's ``cp_size`` and ``cp_rank``), enough
            for TE's layout and for placements whose split sequences all span the whole group
            (else ``ValueError``: pass the topology). ``te`` does CP itself; ``flash`` /
            ``varlen`` run thdpack's ring with FlashAttention-2 tiles; ``math`` runs it with
            exact math tiles (CPU/gloo), or the all-gather of K/V; with ``cp_comm_type="a2a"``
            every backend's own kernel runs on the whole sequences thdpack's all-to-all delivers
            (``te``: TE's all-to-all).
        return_lse: also return the log-sum-exp (differentiable with ``math`` and the CP ring).
        **keywords: ``causal``, ``backend``, ``softmax_scale``, ``cp_comm_type``: a shorthand for
            ``config=AttentionConfig(**keywords)`` (not together with ``config``).

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
    >>> config = AttentionConfig(backend="math")
    >>> thd_attention(x, x, v, thd, config=config).flatten().tolist()  # token 1 averages 0 and 1
    [0.0, 0.5, 2.0, 2.0]
    >>> thd_attention(x, x, v, thd, backend="math", causal=False).flatten().tolist()
    [0.5, 0.5, 2.0, 2.0]
    """
    config = _attention_config(config, keywords)
    _check_qkv(q, k, v)
    meta = thd_meta(thd)
    topology = cp_group if isinstance(cp_group, CpTopology) else None
    group = cp_group if topology is None else _topology_cp_group(topology)
    meta.check_cp_group(group)
    meta.check_token_count(q.shape[0], "q")
    cp = meta.cp_size > 1
    if cp and meta.groups is not None and meta.groups.all_to_all and config.cp_comm_type != "a2a":
        config = _A2A_CONFIGS.setdefault(config, dataclasses.replace(config, cp_comm_type="a2a"))
    situation = CallFacts.of(
        q, k, v, cp=cp, cp_comm_type=config.cp_comm_type, need_lse=return_lse, placed=cp and meta.groups is not None,
        cp_size=meta.cp_size, padded=meta.has_padding,
    )  # fmt: skip
    backend, reason = choose_backend(config.backend, situation)
    log_choice(backend, reason, situation)
    call = AttentionCall(
        thd=thd,
        meta=meta,
        config=config,
        scale=resolve_softmax_scale(config.softmax_scale, q.shape[-1]),
        cp_group=group if cp else None,
        return_lse=return_lse,
        topology=topology,
    )
    out, lse = attend_function(backend, situation)(q, k, v, call)
    return (out, lse) if return_lse else out


def _topology_cp_group(topology: CpTopology) -> dist.ProcessGroup | None:
    """The topology's CP group; one without process groups is refused under CP (``CpTopology.group``)."""
    return topology.group(0, topology.cp_size) if topology.cp_size > 1 else topology.cp_group


def _attention_config(config: AttentionConfig | None, keywords: Mapping[str, Any]) -> AttentionConfig:
    """``config``, or the one the shorthand keywords describe; a mix of both is refused."""
    if not keywords:
        if config is None:
            return _DEFAULT_CONFIG
        if not isinstance(config, AttentionConfig):
            raise TypeError(
                f"config must be a thdpack.attention.AttentionConfig, got {type(config).__name__}; "
                "e.g. config=AttentionConfig(backend='math', causal=False)"
            )
        return config
    unknown = sorted(set(keywords) - set(CONFIG_KEYWORDS))
    if unknown:
        raise TypeError(
            f"thd_attention() got unexpected keyword arguments {unknown}; it takes config, cp_group, return_lse "
            f"and, as a shorthand for config=AttentionConfig(...), {', '.join(CONFIG_KEYWORDS)}"
        )
    if config is not None:
        raise TypeError(
            f"thd_attention() got both config and the keywords {sorted(keywords)}; pass one of them, e.g. "
            f"config=dataclasses.replace(config, {', '.join(f'{name}=...' for name in sorted(keywords))})"
        )
    return AttentionConfig(**keywords)


_DEFAULT_CONFIG = AttentionConfig()
_A2A_CONFIGS: dict[AttentionConfig, AttentionConfig] = {}
"""A config with ``cp_comm_type="a2a"`` per config, for batches whose packs the plan attends by
all-to-all (made once: every layer of every step asks)."""


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
