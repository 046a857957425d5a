"""Whether Transformer Engine can attend a thdpack call: TE's own backend rules, applied beforehand.

``DotProductAttention`` keeps or drops each of its backends (FlashAttention 2 and 3, cuDNN's
FusedAttention, its unfused kernel) by a list of filters and raises when none is left.
:func:`te_problem` applies, to a thdpack call's facts (THD self-attention, ``pad_between_seqs``
whenever a slot holds padding), the filters each TE release (2.5 to 2.18) has, so ``auto`` falls
back before TE raises and ``backend="te"`` refuses with TE's reason. cuDNN's own sub-backend
choice and FP8 recipes are not predicted.

>>> from dataclasses import replace
>>> facts = TEFacts(version=(2, 18), capability=(8, 0), cudnn=(9, 10, 0), flash_attn_2=True, flash_attn_3=False,
...                 pad_between_seqs=True, cp=True, cp_comm_type="p2p", num_heads=8, num_gqa_groups=8,
...                 head_dim_qk=64, head_dim_v=64)
>>> te_problem(facts) is None                    # FusedAttention takes it
True
>>> said = te_problem(replace(facts, deterministic=True))
>>> print(said.split(": ", 1)[0])
Transformer Engine 2.18 has no attention backend for this call (sm80, context parallel p2p, ...)
>>> for part in said.split(": ", 1)[1].split("; "):
...     print(part)
FlashAttention 2: not with padding between sequences (pad_between_seqs)
FlashAttention 3: sm90 only
FusedAttention: deterministic training below sm90
unfused: no context parallelism
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class TEFacts:
    """What Transformer Engine's backend selection reads for one thdpack call."""

    version: tuple[int, ...]
    """Transformer Engine's version, e.g. (2, 18, 0)."""
    capability: tuple[int, int]
    """The GPU's compute capability, e.g. (9, 0)."""
    cudnn: tuple[int, ...]
    """cuDNN's version as TE reads it (``transformer_engine.pytorch.utils.get_cudnn_version``)."""
    flash_attn_2: bool
    """TE found flash-attn 2 (``FlashAttentionUtils.is_installed``)."""
    flash_attn_3: bool
    """TE found flash-attn 3 (``FlashAttentionUtils.v3_is_installed``)."""
    pad_between_seqs: bool
    """A slot holds padding after its real tokens (thdpack passes ``pad_between_seqs`` then)."""
    cp: bool
    """TE runs the call context-parallel (its own ring, all-gather or all-to-all)."""
    cp_comm_type: str
    num_heads: int
    """Query heads TE sees."""
    num_gqa_groups: int
    """Key/value heads TE sees (for TE's all-to-all: after thdpack repeats them so ``cp`` divides them)."""
    head_dim_qk: int
    head_dim_v: int
    half: bool = True
    """fp16 / bf16 tensors."""
    training: bool = True
    """TE's ``is_training`` (the module's ``training`` flag: thdpack's modules never leave it)."""
    deterministic: bool = False
    """``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` or ``torch.use_deterministic_algorithms(True)``."""
    fp8_attention: bool = False
    """Inside ``fp8_autocast`` with a recipe whose ``fp8_dpa`` is on."""

    def describe(self) -> str:
        parts = [f"sm{self.capability[0]}{self.capability[1]}"]
        if self.cp:
            parts.append(f"context parallel {self.cp_comm_type}")
        if self.pad_between_seqs:
            parts.append("padding between sequences")
        if self.deterministic:
            parts.append("deterministic")
        if self.fp8_attention:
            parts.append("FP8 attention")
        if not self.half:
            parts.append("not fp16/bf16")
        return ", ".join(parts)


def te_problem(f: TEFacts) -> str | None:
    """Why Transformer Engine cannot attend a call with the facts ``f`` (TE's words, for the error), or None."""
    asserted = _cp_assertion(f)
    if asserted is not None:
        return asserted
    reasons = {
        "FlashAttention 2": _flash_attention_2(f),
        "FlashAttention 3": _flash_attention_3(f),
        "FusedAttention": _fused_attention(f),
        "unfused": _unfused(f),
    }
    if any(reason is None for reason in reasons.values()):
        return None
    shown = "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
    version = ".".join(map(str, f.version))
    return f"Transformer Engine {version} has no attention backend for this call ({f.describe()}): {shown}"


def _cp_assertion(f: TEFacts) -> str | None:
    """``head_dim % 8 == 0``, which TE's CP functions assert (its ring until 2.8, all-gather and
    all-to-all until 2.15)."""
    if not f.cp or f.head_dim_qk % 8 == 0:
        return None
    until = {"p2p": (2, 8), "all_gather": (2, 15), "a2a": (2, 15)}.get(f.cp_comm_type)
    if until is None or f.version >= until:
        return None
    version = ".".join(map(str, f.version))
    return (
        f"Transformer Engine {version}'s context parallelism (cp_comm_type={f.cp_comm_type!r}) asserts head_dim % 8 "
        f"== 0, and the head dim is {f.head_dim_qk} (TE {until[0]}.{until[1]} dropped the assertion)"
    )


def _flash_attention_2(f: TEFacts) -> str | None:
    if not f.flash_attn_2:
        return "flash-attn 2 is not installed"
    if f.capability < (8, 0):
        return "needs sm80+"
    if not f.half or f.fp8_attention:
        return "fp16/bf16 only"
    padded = max(f.head_dim_qk, f.head_dim_v)
    if padded > 256 or padded % 8 or (padded > 192 and f.capability not in ((8, 0), (9, 0), (10, 0), (12, 0))):
        return f"head dim {padded} (a multiple of 8, <= 256; > 192 only on sm80/90/100/120)"
    if f.pad_between_seqs:
        return "not with padding between sequences (pad_between_seqs)"
    return None


def _flash_attention_3(f: TEFacts) -> str | None:
    if not f.flash_attn_3:
        return "sm90 only" if f.capability != (9, 0) else "flash-attn 3 is not installed"
    if f.capability != (9, 0):
        return "sm90 only"
    if not f.half or (f.fp8_attention and f.training):
        return "fp16/bf16 in training"
    if f.version < (2, 8):
        if f.head_dim_qk > 128 or f.head_dim_v > 128:
            return "head dims <= 128"
    elif not _fa3_head_dims(f):
        return f"head dims {f.head_dim_qk} / {f.head_dim_v} and {f.num_heads} / {f.num_gqa_groups} heads"
    if f.pad_between_seqs and f.version < (2, 16):
        return "not with padding between sequences before TE 2.16"
    if f.deterministic and f.training and f.version >= (2, 15) and max(f.head_dim_qk, f.head_dim_v) >= 256:
        return "deterministic backward needs head dims < 256"
    return None


def _fa3_head_dims(f: TEFacts) -> bool:
    """TE's ``_is_fa3_supported`` (from TE 2.8)."""
    if f.head_dim_qk > 256 or f.num_heads % f.num_gqa_groups:
        return False
    if f.head_dim_qk != f.head_dim_v:
        mla = 128 < f.head_dim_qk <= 192 and 96 < f.head_dim_v <= 128
        return mla or (f.head_dim_qk <= 64 and f.head_dim_v <= 512)
    return True


def _fused_attention(f: TEFacts) -> str | None:
    if f.capability < (8, 0):
        return "needs sm80+"
    if not f.half and not f.fp8_attention:
        return "fp16/bf16 (or FP8) only"
    if f.capability == (12, 0):
        if (2, 9) <= f.version < (2, 14):
            return "THD is not supported on sm120"
        if f.version >= (2, 14) and f.cudnn < (9, 18, 1):
            cudnn = ".".join(map(str, f.cudnn))
            return f"THD on sm120 needs cuDNN >= 9.18.1, found {cudnn}"
    if f.cp and f.fp8_attention and f.version >= (2, 19):
        return "no context parallelism with FP8 attention and THD"
    if f.cp and f.cp_comm_type == "a2a" and f.version >= (2, 15) and (f.num_heads % 2 or f.num_gqa_groups % 2):
        return f"cp_comm_type='a2a' needs even head counts, got {f.num_heads} / {f.num_gqa_groups}"
    if f.deterministic and f.training and f.capability < (9, 0):
        return "deterministic training below sm90"
    return None


def _unfused(f: TEFacts) -> str | None:
    if f.cp:
        return "no context parallelism"
    if f.fp8_attention:
        return "no FP8 attention"
    if f.version < (2, 11):
        return "no THD before TE 2.11"
    if f.pad_between_seqs and f.version >= (2, 16):
        return "not with padding between sequences"
    return None
