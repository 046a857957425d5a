"""``te`` backend: Transformer Engine's ``DotProductAttention`` in THD format, CP included.

A thin adapter to TE's documented API: local q/k/v, global ``cu_seqlens`` /
``cu_seqlens_padded`` / ``max_seqlen``, ``qkv_format="thd"``, and under CP
``set_context_parallel_group``, after which TE runs every exchange itself. KV heads are repeated
where ``cp`` does not divide them, as thdpack's own all-to-all does. ``pad_between_seqs=True`` is
passed whenever slots hold padding: without it TE's auto-detection drops real keys (TE issue
#3331). Which of TE's backends can take a call is predicted beforehand (``te_rules``). TE returns
no LSE.

Legend: ``T`` local tokens, ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

import thdpack._optional as _optional
from thdpack.attention.backends.base import AttentionBackend, AttentionCall, AttentionOutput, CallFacts
from thdpack.attention.backends.te_rules import TEFacts, te_problem
from thdpack.attention.heads import kv_replication, repeat_kv_heads

# DotProductAttention modules hold no weights (vanilla softmax); one per configuration
_MODULES: dict[tuple[Any, ...], Any] = {}
_CP_STREAMS: dict[torch.device, Any] = {}
THD_CP_SINCE: dict[str, tuple[tuple[int, int], str, str]] = {
    "all_gather": ((2, 18), "AttnFuncWithCPAndKVAllGather", "backend='math'"),
    "a2a": ((2, 10), "AttnFuncWithCPAndQKVOA2A", "another backend (thdpack's all-to-all)"),
}
"""cp_comm_type -> (the first Transformer Engine whose context parallelism of that kind takes THD,
the class whose ``assert qkv_format != "thd"`` refuses it before, the other way out)."""


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
    if s.cp and s.cp_comm_type in THD_CP_SINCE and version is not None:
        since, refuses, other = THD_CP_SINCE[s.cp_comm_type]
        if version < since:
            return ValueError(
                f"backend 'te' with cp_comm_type={s.cp_comm_type!r} needs Transformer Engine >= "
                f"{'.'.join(map(str, since))} for THD batches (before it {refuses} asserts qkv_format != 'thd'), "
                f"found {'.'.join(map(str, version))}; use cp_comm_type='p2p', upgrade Transformer Engine, or {other}"
            )
    facts = te_facts(s)
    problem = te_problem(facts) if facts is not None else None
    if problem is not None:
        return ValueError(
            f"backend 'te': {problem}; use backend='flash' or 'varlen' (thdpack's ring with FlashAttention-2 tiles), "
            "or 'math'"
        )
    return None


def te_facts(s: CallFacts) -> TEFacts | None:
    """What Transformer Engine's backend selection would read for a call in situation ``s`` (None
    when TE, its kernels, the GPU or the head counts are unknown: nothing is predicted)."""
    version, kernels = _optional.transformer_engine_version(), _optional.transformer_engine_kernels()
    if version is None or kernels is None or s.capability is None or s.num_heads is None or s.num_kv_heads is None:
        return None
    kv_heads = s.num_kv_heads
    if s.cp and s.cp_comm_type == "a2a" and s.num_heads % s.cp_size == 0:  # attend repeats them for TE's all-to-all
        kv_heads *= kv_replication(s.num_heads, s.num_kv_heads, s.cp_size)
    return TEFacts(
        version=version,
        capability=s.capability,
        cudnn=kernels.cudnn,
        flash_attn_2=kernels.flash_attn_2,
        flash_attn_3=kernels.flash_attn_3,
        pad_between_seqs=s.padded,
        cp=s.cp,
        cp_comm_type=s.cp_comm_type,
        num_heads=s.num_heads,
        num_gqa_groups=kv_heads,
        head_dim_qk=s.head_dim if s.head_dim is not None else 0,
        head_dim_v=s.head_dim_v if s.head_dim_v is not None else 0,
        half=s.cuda_half,
        deterministic=os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1") == "0"
        or torch.are_deterministic_algorithms_enabled(),
        fp8_attention=_fp8_attention(),
    )


def _fp8_attention() -> bool:
    """Inside Transformer Engine's ``fp8_autocast`` with a recipe that quantizes attention (``fp8_dpa``).

    Read from TE's module only if something imported it: ``fp8_autocast`` lives there."""
    manager = getattr(sys.modules.get("transformer_engine.pytorch.fp8"), "FP8GlobalStateManager", None)
    if manager is None or not manager.is_fp8_enabled():
        return False
    return bool(getattr(manager.get_fp8_recipe(), "fp8_dpa", False))


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
