"""What one rank's device and host do in a given time: ``thdpack calibrate``'s kernel timings.

The attention kernel's achieved FLOP/s against sequence length (causal forward, full forward,
backward) and its fixed cost per call, the model's GEMMs, a large copy, and one eager op on the
host, in ``thdpack.perf``'s units and conventions. Each time is the fastest of ``repeats`` runs
after one warm-up (``timed_runs``): on a shared machine a slower run is another process's time,
not the kernel's.

Legend: ``T`` tokens, ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from thdpack.attention.api import thd_attention
from thdpack.perf.shape import ATTENTION_BACKWARD_FACTOR, ModelShape
from thdpack.thd.batch import thd_collate, thd_to_device

HOST_CHAIN = 200
"""Multiplications in the chain the host's op cost is timed on (forward and backward: twice as many ops)."""


def timed_runs(
    fn: Callable[[], object],
    device: torch.device,
    repeats: int,
    *,
    before: Callable[[], object] | None = None,
    wait_for_device: bool = True,
) -> list[float]:
    """Wall seconds of each of ``repeats`` runs of ``fn()``, after one warm-up run.

    On a GPU the device is synchronised before each run and, with ``wait_for_device``, after it,
    so a run's time holds its kernels; ``wait_for_device=False`` times the host alone.
    ``before`` runs ahead of each run, outside its time (a barrier, so every rank starts together).
    """

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    samples = []
    for _ in range(repeats):
        if before is not None:
            before()
        sync()
        start = time.perf_counter()
        fn()
        if wait_for_device:
            sync()
        samples.append(time.perf_counter() - start)
    return samples


def fastest_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The fastest wall seconds of ``fn()`` over ``repeats`` runs after one warm-up, synchronised on a GPU."""
    return min(timed_runs(fn, device, repeats))


@dataclass(frozen=True)
class AttentionCurves:
    """Achieved FLOP/s of the attention kernel against sequence length (``thdpack.perf``'s curves)."""

    forward_causal: list[list[float]]
    forward_full: list[list[float]]
    backward: list[list[float]]
    call_overhead_s: float
    """Seconds of one call on a one-token sequence."""


def equal_batch(length: int, count: int, device: torch.device) -> dict:
    """A THD batch of ``count`` sequences of ``length`` tokens on ``device``."""
    tokens = length * count
    pack = {"input_ids": [0] * tokens, "labels": [0] * tokens, "position_ids": list(range(length)) * count,
            "seq_lens": [length] * count, "seq_lens_padded": [length] * count}  # fmt: skip
    return thd_to_device(thd_collate([pack]), device)


def attention_curves(
    shape: ModelShape,
    *,
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    lengths: list[int],
    tokens: int,
    repeats: int,
    deadline: float,
) -> AttentionCurves:
    """The three curves at ``lengths`` (ascending; a length whose timing would end past
    ``deadline``, a ``time.monotonic()``, is skipped with the longer ones, at least two are
    measured: a doubled length at the same tokens does twice the work) and the per-call cost."""
    per_pair = shape.attention_flops_per_pair()
    g = torch.Generator(device=device).manual_seed(0)

    def tensors(n_tokens: int) -> tuple[torch.Tensor, ...]:
        heads = (shape.heads, shape.kv_heads, shape.kv_heads, shape.heads)
        made = [torch.randn(n_tokens, h, shape.head_dim, generator=g, device=device, dtype=dtype) for h in heads]
        return tuple(t.requires_grad_(i < 3) for i, t in enumerate(made))

    def run(thd: dict, qkv: tuple[torch.Tensor, ...], causal: bool, backward: bool) -> None:
        q, k, v, dout = qkv
        out = thd_attention(q, k, v, thd, backend=backend, causal=causal)
        if backward:
            torch.autograd.grad(out, (q, k, v), dout)

    curves: dict[str, list[list[float]]] = {"forward_causal": [], "forward_full": [], "backward": []}
    took = 0.0
    for i, n in enumerate(lengths):
        began = time.monotonic()
        if i >= 2 and began + 2.2 * took > deadline:
            break
        count = max(1, tokens // n)
        case = (equal_batch(n, count, device), tensors(n * count))
        causal, full, both = (
            fastest_seconds(lambda c=causal_, b=backward_: run(*case, c, b), device, repeats)  # noqa: B023
            for causal_, backward_ in ((True, False), (False, False), (False, True))
        )
        pairs = count * n * n
        curves["forward_causal"].append([n, per_pair * pairs / 2 / causal])
        curves["forward_full"].append([n, per_pair * pairs / full])
        backward = max(both - full, 0.5 * full)  # a backward never runs faster than half its forward
        curves["backward"].append([n, ATTENTION_BACKWARD_FACTOR * per_pair * pairs / backward])
        took = time.monotonic() - began
    one = (equal_batch(1, 1, device), tensors(1))
    overhead = fastest_seconds(lambda: run(*one, True, False), device, repeats)
    return AttentionCurves(**curves, call_overhead_s=overhead)


def matmul_flops(shape: ModelShape, *, tokens: int, device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    """Achieved FLOP/s of the model's GEMMs on ``tokens`` rows: QKV, output, MLP and logits."""
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    mlp = [(shape.hidden, shape.ffn)] * (2 if shape.gated_mlp else 1) + [(shape.ffn, shape.hidden)]
    gemms = [(shape.hidden, qkv), (shape.heads * shape.head_dim, shape.hidden), *mlp, (shape.hidden, shape.vocab)]
    g = torch.Generator(device=device).manual_seed(0)
    flops = seconds = 0.0
    for rows, cols in gemms:
        x = torch.randn(tokens, rows, generator=g, device=device, dtype=dtype)
        w = torch.randn(rows, cols, generator=g, device=device, dtype=dtype)
        seconds += fastest_seconds(lambda x=x, w=w: x @ w, device, repeats)
        flops += 2.0 * tokens * rows * cols
    return flops / seconds


def memory_bandwidth(*, device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes per second of copying a ``nbytes`` buffer (read and written)."""
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2.0 * src.numel() * 4 / fastest_seconds(lambda: dst.copy_(src), device, repeats)


def host_op_seconds(*, device: torch.device, repeats: int) -> float:
    """Host seconds of one eager op: a chain of ``HOST_CHAIN`` multiplications of a small tensor
    with autograd, forward and backward (one op each), timed without waiting for the device."""
    x = torch.ones(16, device=device, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(HOST_CHAIN):
            y = y * 1.0
        y.sum().backward()

    return min(timed_runs(chain, device, repeats, wait_for_device=False)) / (2 * HOST_CHAIN)
