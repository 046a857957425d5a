"""``te`` backend: Transformer Engine's ``DotProductAttention`` in THD format, CP included.

A thin adapter, true to TE's documented API (research/nemo_te_spec.md 1.8, 2.5): local q/k/v,
GLOBAL ``cu_seqlens`` / ``cu_seqlens_padded`` / ``max_seqlen``, ``qkv_format="thd"``,
``attn_mask_type="padding_causal"`` (or ``"padding"``), and under CP
``set_context_parallel_group(group, ranks, stream, cp_comm_type)``: TE runs every CP exchange
itself (``p2p``, ``all_gather`` from TE 2.18 with THD, ``a2a`` from TE 2.10 with THD). TE's
all-to-all needs ``cp`` to divide both head counts; where it does not divide the KV heads, they
are repeated first, as thdpack's own all-to-all does (:func:`thdpack.attention.heads.kv_replication`).
``pad_between_seqs=True`` is passed whenever slots hold padding: TE's auto-detection path without
it drops real keys (TE issue #3331). TE returns no LSE.

Legend: ``T`` local tokens, ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from thdpack import _optional
from thdpack.attention.backends.base import AttentionBackend, AttentionCall, AttentionOutput, CallFacts
from thdpack.attention.heads import kv_replication, repeat_kv_heads

# DotProductAttention modules hold no weights (vanilla softmax); one per configuration
_MODULES: dict[tuple[Any, ...], Any] = {}
_CP_STREAMS: dict[torch.device, Any] = {}
ALL_GATHER_THD_SINCE = (2, 18)
"""The first Transformer Engine whose all-gather context parallelism takes THD."""
A2A_THD_SINCE = (2, 10)
"""The first Transformer Engine whose all-to-all context parallelism takes THD (2.9's
``AttnFuncWithCPAndQKVOA2A`` asserts ``qkv_format != "thd"``)."""


def kernel_problem(s: CallFacts) -> Exception | None:
    if not _optional.has_transformer_engine():
        return ImportError(
            "backend 'te' needs Transformer Engine with CUDA, which does not import here; "
            "pip install 'thdpack[te]' on a CUDA machine, or use backend='varlen', 'flash' or 'math'"
        )
    if not s.cuda_half:
        return ValueError(f"backend 'te' needs CUDA float16/bfloat16 tensors, got {s.device.type} {s.dtype}")
    if s.need_lse:
        return ValueError(
            "backend 'te' does not return the LSE (DotProductAttention has no such output); "
            "use backend='varlen' / 'flash' (CUDA) or 'math'"
        )
    version = _optional.transformer_engine_version()
    if s.cp and s.cp_comm_type == "all_gather" and version is not None and version < ALL_GATHER_THD_SINCE:
        found = ".".join(map(str, version))
        return ValueError(
            f"backend 'te' with cp_comm_type='all_gather' needs Transformer Engine >= 2.18 for THD batches "
            f"(before it AttnFuncWithCPAndKVAllGather asserts qkv_format != 'thd'), found {found}; "
            "use cp_comm_type='p2p', upgrade Transformer Engine, or backend='math'"
        )
    if s.cp and s.cp_comm_type == "a2a" and version is not None and version < A2A_THD_SINCE:
        found = ".".join(map(str, version))
        return ValueError(
            f"backend 'te' with cp_comm_type='a2a' needs Transformer Engine >= 2.10 for THD batches "
            f"(before it AttnFuncWithCPAndQKVOA2A asserts qkv_format != 'thd'), found {found}; "
            "use cp_comm_type='p2p', upgrade Transformer Engine, or another backend (thdpack's all-to-all)"
        )
    return None


def _module(q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor, **settings: Any) -> Any:
    key = (q_TNH.shape[1:], k_TNH.shape[1:], v_TNH.shape[-1], q_TNH.device, *sorted(settings.items()))
    if key in _MODULES:
        return _MODULES[key]
    te = _optional.require("transformer_engine.pytorch", "the 'te' attention backend")
    head_dim, head_dim_v = q_TNH.shape[-1], v_TNH.shape[-1]
    dpa = te.DotProductAttention(
        num_attention_heads=q_TNH.shape[1],
        kv_channels=head_dim if head_dim == head_dim_v else (head_dim, head_dim_v),
        num_gqa_groups=k_TNH.shape[1],
        qkv_format="thd",
        attn_mask_type=settings["attn_mask_type"],
        softmax_scale=settings["softmax_scale"],
    )
    group = settings["cp_group"]
    if group is not None:
        if q_TNH.device not in _CP_STREAMS:
            _CP_STREAMS[q_TNH.device] = torch.cuda.Stream(device=q_TNH.device)
        dpa.set_context_parallel_group(
            group,
            dist.get_process_group_ranks(group),
            _CP_STREAMS[q_TNH.device],
            cp_comm_type=settings["cp_comm_type"],
        )
    _MODULES[key] = dpa
    return dpa


def attend(q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor, call: AttentionCall) -> AttentionOutput:
    """``(out (T, Nq, Hv), None)`` for this rank's tokens (TE does the CP exchange itself)."""
    cu_seqlens = call.cu_seqlens("cu_seqlens", q_TNH.device)
    cu_seqlens_padded = call.cu_seqlens("cu_seqlens_padded", q_TNH.device)
    mask_type = "padding_causal" if call.causal else "padding"
    nq, hv = q_TNH.shape[1], v_TNH.shape[-1]
    if call.cp_group is not None and call.config.cp_comm_type == "a2a":
        copies = kv_replication(nq, k_TNH.shape[1], call.meta.cp_size)
        k_TNH, v_TNH = repeat_kv_heads(k_TNH, v_TNH, copies)
    dpa = _module(
        q_TNH, k_TNH, v_TNH, attn_mask_type=mask_type, softmax_scale=call.scale,
        cp_group=call.cp_group, cp_comm_type=call.config.cp_comm_type,
    )  # fmt: skip
    out = dpa(
        q_TNH, k_TNH, v_TNH, qkv_format="thd", attn_mask_type=mask_type,
        cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=call.meta.max_seqlen, max_seqlen_kv=call.meta.max_seqlen, pad_between_seqs=call.meta.has_padding,
    )  # fmt: skip
    return out.view(q_TNH.shape[0], nq, hv), None


BACKEND = AttentionBackend(
    name="te", cp={"p2p": "own", "all_gather": "own", "a2a": "own"}, kernel_problem=kernel_problem, attend=attend
)
