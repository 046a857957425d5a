"""How fast the ranks talk: ``thdpack calibrate``'s timings of sends and collectives.

Over a process group, at a few buffer sizes: the ring exchange thdpack's ring runs, fitted as
``latency + bytes / bandwidth``, and the four collectives of ``thdpack.perf.comm``, whose bus factors
are measured instead of assumed. Each timing is the slowest rank's: the group waits for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from thdpack.calibrate.kernels import timed_runs
from thdpack.cp.comm import RingComm, all_gather_rows, all_to_all_blocks, reduce_scatter_rows
from thdpack.perf.machine import COLLECTIVES


@dataclass(frozen=True)
class LinkFit:
    """One group's measured link and collectives."""

    bandwidth: float
    """Bytes per second one rank sends to its neighbour."""
    latency_s: float
    """Seconds of an exchange of nothing (the fit's intercept)."""
    factors: dict[str, float]
    """``COLLECTIVES`` -> bus factor (nccl-tests' 2 for all-reduce, 1 for the others, when the
    collective moves its bytes at the link's speed)."""
    ranks: int
    sizes: list[int]


def _group_seconds(fn: Callable[[], object], group: dist.ProcessGroup, device: torch.device, repeats: int) -> float:
    """The slowest rank's fastest seconds of ``fn()`` (every rank of ``group`` calls it together)."""
    fastest = min(timed_runs(fn, device, repeats, before=lambda: dist.barrier(group=group)))
    slowest = torch.tensor([fastest], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest)


def _fit(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """``(intercept, slope)`` of seconds against bytes, both >= 0 (least squares)."""
    slope, intercept = np.polyfit(np.asarray(sizes, dtype=np.float64), np.asarray(seconds), 1)
    slope = max(float(slope), 1e-15)
    return max(float(intercept), 0.0), slope


def measure_link(group: dist.ProcessGroup, *, device: torch.device, sizes: list[int], repeats: int) -> LinkFit:
    """The ring exchange and the four collectives over ``group`` at ``sizes`` bytes per rank."""
    n = dist.get_world_size(group)
    ring = RingComm(group)

    def buffer(nbytes: int) -> torch.Tensor:
        rows = -(-nbytes // (4 * n)) * n  # a whole number of rows per rank, for the row collectives
        return torch.ones(rows, device=device, dtype=torch.float32)

    def op(kind: str, x: torch.Tensor) -> Callable[[], object]:
        if kind == "exchange":
            return lambda: ring.send_recv([x]).wait()
        if kind == "all_reduce":
            return lambda: dist.all_reduce(x, group=group)
        if kind == "all_gather":
            return lambda: all_gather_rows(x, group)
        if kind == "reduce_scatter":
            return lambda: reduce_scatter_rows(x, group)
        return lambda: all_to_all_blocks(x.view(n, -1), group)

    fits = {}
    for kind in ("exchange", *COLLECTIVES):
        buffers = [buffer(s) for s in sizes]
        seconds = [_group_seconds(op(kind, x), group, device, repeats) for x in buffers]
        gathered = n if kind == "all_gather" else 1  # nccl-tests counts an all-gather's output
        fits[kind] = _fit([x.numel() * 4 * gathered for x in buffers], seconds)
    latency, slope = fits["exchange"]
    bandwidth = 1.0 / slope
    factors = {k: fits[k][1] * bandwidth * n / (n - 1) for k in COLLECTIVES}
    return LinkFit(bandwidth=bandwidth, latency_s=latency, factors=factors, ranks=n, sizes=sizes)
