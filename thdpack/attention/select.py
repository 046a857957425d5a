"""Which backend runs a call: availability checks, the ``auto`` choice and its log line.

``auto`` walks a preference list for the situation (device, dtype, context parallelism, whether
the LSE or gradients are needed) and takes the first backend that can run; the choice and the
reasons the faster ones were skipped are logged once per distinct outcome on the
``thdpack.attention`` logger (INFO). An explicit backend that cannot run raises: ``ImportError``
when a package is missing (naming what to install), ``ValueError`` when the situation does not
fit (naming what to pick instead).

Preferences (fastest first):

=================================  ===============================================================
CUDA fp16/bf16, no CP              te, flash, varlen, flex, sdpa, math
CUDA fp16/bf16, CP                 te (TE's own CP), flash (thdpack ring, FlashAttention-2 tiles), math
CUDA fp32                          flex (fused Triton kernel), math
CPU, with or without CP            math (exact tiles with backward; flex has no CPU backward in
                                   torch >= 2.11; sdpa needs a dense T x T mask, returns no LSE)
=================================  ===============================================================

On CPU the math kernel's per-sequence tiles beat SDPA's dense masked kernel as packs grow
(``benchmarks/attention_bench.py``, 2 cores, fp32, 8/2 heads x 64, SFT-like packs, forward +
backward: 56 vs 67 ms at 1024 tokens, 0.47 vs 1.08 s at 4096, 0.77 vs 4.43 s at 8192).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from thdpack import _optional
from thdpack.attention import flash_kernel
from thdpack.attention.config import Backend, CpCommType, check_backend

log = logging.getLogger("thdpack.attention")

ENV_VAR = "THDPACK_ATTENTION_BACKEND"
_LOGGED: set[tuple[str, str]] = set()


@dataclass(frozen=True, kw_only=True)
class Situation:
    """The facts of one call that decide which backends can run it."""

    device: torch.device
    dtype: torch.dtype
    cp: bool
    """A CP group of size > 1."""
    cp_comm_type: CpCommType
    need_lse: bool
    need_grad: bool

    @property
    def cuda_half(self) -> bool:
        return self.device.type == "cuda" and self.dtype in flash_kernel.HALF_DTYPES


def _torch_at_least(major: int, minor: int) -> bool:
    found = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return found >= (major, minor)


def problem(backend: Backend, s: Situation) -> Exception | None:
    """Why ``backend`` cannot run in situation ``s`` (an exception to raise), or None."""
    if backend == "math":
        return None
    if backend == "te":
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
        return None
    if s.cp:
        if backend in ("sdpa", "flex"):
            return ValueError(
                f"backend {backend!r} has no context-parallel path; with a cp_group use 'math' (any "
                "device), 'flash' / 'varlen' (CUDA fp16/bf16 ring) or 'te'"
            )
        if s.cp_comm_type == "all_gather":
            return ValueError(
                f"cp_comm_type='all_gather' runs math tiles; use backend='math' (or 'te'), or "
                f"cp_comm_type='p2p' for the {backend!r} ring"
            )
        reason = flash_kernel.unavailable_reason(s.device, s.dtype)
        if reason is not None:
            return ValueError(f"backend {backend!r} under context parallelism: {reason}; use backend='math'")
        return None
    if backend == "flash":
        if not _optional.has_flash_attn():
            return ImportError(
                "backend 'flash' needs flash-attn (flash_attn_varlen_func), which is not installed; "
                "pip install 'thdpack[flash]', or use backend='varlen' (torch >= 2.10) or 'math'"
            )
        return _needs_cuda_half(backend, s)
    if backend == "varlen":
        if not _optional.has_varlen_attn():
            return ImportError(
                f"backend 'varlen' needs torch.nn.attention.varlen (torch >= 2.10), not in torch "
                f"{torch.__version__}; upgrade torch, or use backend='flash' or 'math'"
            )
        return _needs_cuda_half(backend, s)
    if backend == "flex":
        if not _optional.has_flex_attention():
            return ImportError(
                f"backend 'flex' needs torch.nn.attention.flex_attention (torch >= 2.5), not in torch "
                f"{torch.__version__}; use backend='math'"
            )
        if s.device.type == "cpu" and s.need_grad and _torch_at_least(2, 11):
            return ValueError(
                "backend 'flex' has no backward on CPU (torch >= 2.11 raises NotImplementedError); "
                "use backend='math' (exact, with backward) or run without gradients"
            )
        return None
    if backend == "sdpa":
        if s.need_lse:
            return ValueError(
                "backend 'sdpa' does not return the LSE (scaled_dot_product_attention has no such "
                "output); use backend='math' or 'flex'"
            )
        return None
    raise AssertionError(f"unhandled backend {backend!r}")


def _needs_cuda_half(backend: str, s: Situation) -> Exception | None:
    reason = flash_kernel.unavailable_reason(s.device, s.dtype)
    if reason is None:
        return None
    return ValueError(f"backend {backend!r}: {reason}; use backend='math' (any device and dtype) or 'flex'")


def _preferences(s: Situation) -> tuple[tuple[Backend, str], ...]:
    if s.cuda_half and s.cp:
        return (
            ("te", "Transformer Engine's fused kernels and its own context parallelism"),
            ("flash", "thdpack's ring with FlashAttention-2 tiles"),
            ("math", "thdpack's ring with exact math tiles"),
        )
    if s.cp:
        return (("math", "thdpack's ring with exact math tiles (no CUDA fp16/bf16 kernels apply)"),)
    if s.cuda_half:
        return (
            ("te", "Transformer Engine's fused attention"),
            ("flash", "flash-attn varlen kernel"),
            ("varlen", "torch varlen_attn (FlashAttention-2)"),
            ("flex", "FlexAttention with a block-sparse document mask"),
            ("sdpa", "scaled_dot_product_attention with a dense mask"),
            ("math", "exact tiled math kernel"),
        )
    if s.device.type == "cuda":
        return (
            ("flex", "FlexAttention, the fused kernel for fp32 on CUDA"),
            ("math", "exact tiled math kernel"),
        )
    return (("math", "exact tiled math kernel: per-sequence tiles, LSE and backward on CPU"),)


def choose_backend(requested: str, s: Situation) -> tuple[Backend, str]:
    """``(backend, reason)`` for a call; raises when a forced backend cannot run.

    ``requested`` is the ``backend`` argument; when it is ``"auto"`` the environment variable
    ``THDPACK_ATTENTION_BACKEND`` (if set) forces a backend instead.
    """
    backend = check_backend(requested)
    reason = "requested"
    if backend == "auto" and os.environ.get(ENV_VAR):
        backend = check_backend(os.environ[ENV_VAR], f"{ENV_VAR} value")
        reason = f"forced by {ENV_VAR}"
    if backend != "auto":
        err = problem(backend, s)
        if err is not None:
            raise err
        return backend, reason
    skipped = []
    for candidate, why in _preferences(s):
        err = problem(candidate, s)
        if err is None:
            if skipped:
                why = f"{why}; skipped {'; '.join(skipped)}"
            return candidate, why
        skipped.append(f"{candidate} ({err})")
    raise AssertionError("the 'math' backend always runs")


def log_choice(backend: str, reason: str, s: Situation) -> None:
    """INFO line, once per distinct (backend, reason, situation)."""
    key = (backend, f"{reason}|{s}")
    if key not in _LOGGED:
        _LOGGED.add(key)
        where = f"{s.device.type} {str(s.dtype).removeprefix('torch.')}{', context parallel' if s.cp else ''}"
        log.info("thdpack attention backend %r on %s: %s", backend, where, reason)
