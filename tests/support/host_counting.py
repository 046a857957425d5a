"""Count the eager ops thdpack's code issues: every non-view ATen op dispatched, except those of the
math tiles (a CPU times them with the kernel; ``thdpack.perf.host`` counts a FlashAttention tile's
own). The recounts behind ``thdpack.perf.host.THDPACK``'s constants."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import thdpack

PACKAGE = Path(thdpack.__file__).resolve().parent
KERNEL_FILES = ("attention/math_kernel.py", "attention/masks.py")


class OpCounter(TorchDispatchMode):
    """Counts non-view ATen ops, leaving out those issued inside the math tiles."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and not _inside_kernel():
            self.ops += 1
        return func(*args, **(kwargs or {}))


def _inside_kernel() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(str(PACKAGE)):  # the innermost thdpack frame decides
            return name.endswith(KERNEL_FILES)
        frame = frame.f_back
    return False


def count(fn) -> int:
    """Ops ``fn()`` issues."""
    with OpCounter() as counter:
        fn()
    return counter.ops


def forward_backward_ops(forward) -> tuple[int, int]:
    """``(forward ops, backward ops)`` of ``forward()`` (returns a tensor) and its backward, after
    one warm-up run that fills the caches a step's first layer fills."""
    forward().sum().backward()
    with OpCounter() as counter:
        out = forward()
    total = out.sum()
    with OpCounter() as backward:
        total.backward()
    return counter.ops, backward.ops


def thd_batch(lengths: list[int]) -> dict:
    from thdpack.thd import thd_collate

    tokens = sum(lengths)
    return thd_collate([{
        "input_ids": [1] * tokens, "labels": [1] * tokens, "position_ids": [p for n in lengths for p in range(n)],
        "seq_lens": list(lengths), "seq_lens_padded": list(lengths),
    }])  # fmt: skip


def qkv(tokens: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(tokens, n, 8, generator=g, requires_grad=True) for n in (4, 2, 2))
