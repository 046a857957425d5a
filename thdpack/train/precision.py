"""Numeric precision of a training run: where the weights live and what the matmuls compute in.

``fp32`` and ``fp64`` train in one dtype. ``bf16-mixed`` keeps fp32 master weights, AdamW state
and checkpoints and computes in bf16 (the loss in fp32): under ``torch.autocast`` with DDP, by
FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` with FSDP. Pure bf16 is not
offered: an AdamW update of 6e-4 on a weight of 1.0 rounds away in bf16 (its spacing there is
2**-7), so norm gains would never move.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

PRECISIONS = ("fp32", "bf16-mixed", "fp64")
"""The values of ``train.precision``."""


@dataclass(frozen=True)
class Precision:
    """One of :data:`PRECISIONS`, resolved to dtypes.

    >>> Precision.named("bf16-mixed")
    Precision(name='bf16-mixed', param_dtype=torch.float32, compute_dtype=torch.bfloat16)
    >>> Precision.named("fp64").compute_dtype is None
    True
    """

    name: str
    param_dtype: torch.dtype
    """Master weights, gradients, optimizer state and checkpoints."""
    compute_dtype: torch.dtype | None
    """The autocast / FSDP compute dtype; None: compute in ``param_dtype``."""

    @classmethod
    def named(cls, name: str) -> Precision:
        if name == "fp32":
            return cls(name, torch.float32, None)
        if name == "fp64":
            return cls(name, torch.float64, None)
        if name == "bf16-mixed":
            return cls(name, torch.float32, torch.bfloat16)
        raise ValueError(f"unknown precision {name!r}; valid: {', '.join(PRECISIONS)}")

    def autocast(self, device: torch.device | str) -> contextlib.AbstractContextManager:
        """The forward pass's context: bf16 autocast for ``bf16-mixed``, else nothing."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
        return torch.autocast(device_type, dtype=self.compute_dtype)

    def fsdp_policy(self):
        """FSDP2's ``MixedPrecisionPolicy`` (bf16 compute, fp32 reduce), or None."""
        if self.compute_dtype is None:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=self.param_dtype)
