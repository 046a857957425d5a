"""Kernel times on one GPU: the linear layers, and the attention kernel on blocks of given sizes.

Linear layers run at ``peak_flops x matmul_efficiency``. The attention kernel runs at the
profile's achieved FLOP/s for the length of the block it attends (the side of the square of equal
work), interpolated between the measured lengths; below the shortest, every launched tile costs
what it costs there (docs/design/step_model.md, "Kernels"). Times are per layer unless a name
says otherwise. Legend: ``S`` blocks (sequences).

>>> from thdpack.perf.machine import load_profile
>>> from thdpack.perf.shape import ModelShape
>>> k = KernelTimes(load_profile("h100_sxm"), ModelShape(layers=1, hidden=2048, ffn=8192, heads=16, kv_heads=16,
...                                                     head_dim=128, vocab=32000))
>>> fwd, bwd = k.causal(np.array([16384.0]))
>>> round(float(4 * 2048 * 16384**2 / 2 / fwd[0]) / 1e12)     # the profile's causal rate at 16k
616
>>> [round(float(k.causal(np.array([n]))[0][0]) * 1e6, 2) for n in (64.0, 128.0)]  # one tile each: same time
[0.37, 0.37]
"""

from __future__ import annotations

import numpy as np

from thdpack.perf.machine import MachineProfile
from thdpack.perf.shape import ATTENTION_BACKWARD_FACTOR, ModelShape

BACKWARD_KERNELS = 3
"""Kernels one attention backward call launches (FlashAttention: the dO.O preprocess, the main
kernel, the dQ conversion); the forward launches one."""


def _seconds(flops: np.ndarray, rate: np.ndarray) -> np.ndarray:
    """``flops / rate``, 0 for an empty block (whose rate is 0 too)."""
    return np.divide(flops, rate, out=np.zeros_like(flops), where=flops > 0)


class _Curve:
    """Achieved FLOP/s against block side, from a profile curve."""

    def __init__(self, points: tuple[tuple[float, float], ...], tile: int) -> None:
        self.log_lengths = np.log2([p[0] for p in points])
        self.rates = np.array([p[1] for p in points])
        self.shortest = float(points[0][0])
        self.tile = tile

    def rate(self, side: np.ndarray, useful: np.ndarray, useful_at_shortest: float) -> np.ndarray:
        """FLOP/s for blocks of equal-work ``side`` whose launched tiles are ``useful`` full."""
        side = np.maximum(side, 1.0)
        rate = np.interp(np.log2(side), self.log_lengths, self.rates)
        short = side < self.shortest
        return np.where(short, self.rates[0] * useful / useful_at_shortest, rate)


class KernelTimes:
    """Seconds of a rank's kernels for one model on one machine."""

    def __init__(self, profile: MachineProfile, shape: ModelShape) -> None:
        self.profile, self.shape = profile, shape
        att = profile.attention
        self.tile = att.tile
        self.per_pair = shape.attention_flops_per_pair()
        self.forward_causal = _Curve(att.forward_causal, att.tile)
        self.forward_full = _Curve(att.forward_full, att.tile)
        self.backward = _Curve(att.backward, att.tile)
        self.linear_rate = profile.peak_flops * profile.matmul_efficiency

    def linear(self, tokens: np.ndarray | float) -> np.ndarray:
        """Forward + backward seconds of every layer's linear work and the logits for ``tokens``."""
        return np.asarray(tokens, dtype=np.float64) * (self.shape.linear_flops_per_token() / self.linear_rate)

    def _causal_useful(self, n: np.ndarray) -> np.ndarray:
        blocks = np.ceil(np.maximum(n, 1.0) / self.tile)
        return (n * n / 2) / (blocks * (blocks + 1) / 2 * self.tile**2)

    def _full_useful(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        tiles = np.ceil(np.maximum(rows, 1.0) / self.tile) * np.ceil(np.maximum(cols, 1.0) / self.tile)
        return rows * cols / (tiles * self.tile**2)

    def causal(self, n_S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) seconds of one layer's causal ``n x n`` blocks, (S,) each (0 for n = 0)."""
        n = np.asarray(n_S, dtype=np.float64)
        flops = self.per_pair * n * n / 2
        useful = self._causal_useful(n)
        s0 = self.forward_causal.shortest
        fwd_rate = self.forward_causal.rate(n, useful, float(self._causal_useful(np.array(s0))))
        full_rate = self.forward_full.rate(n, self._full_useful(n, n), float(self._full_useful(np.array(s0), s0)))
        bwd_rate = self.backward.rate(n, useful, float(self._causal_useful(np.array(self.backward.shortest))))
        bwd_rate = bwd_rate * fwd_rate / full_rate
        return _seconds(flops, fwd_rate), _seconds(ATTENTION_BACKWARD_FACTOR * flops, bwd_rate)

    def full(self, rows_S: np.ndarray, cols_S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) seconds of one layer's full ``rows x cols`` blocks, (S,) each."""
        rows = np.asarray(rows_S, dtype=np.float64)
        cols = np.asarray(cols_S, dtype=np.float64)
        flops = self.per_pair * rows * cols
        side = np.sqrt(rows * cols)
        useful = self._full_useful(rows, cols)
        s0 = self.forward_full.shortest
        fwd_rate = self.forward_full.rate(side, useful, float(self._full_useful(np.array(s0), s0)))
        b0 = self.backward.shortest
        bwd_rate = self.backward.rate(side, useful, float(self._full_useful(np.array(b0), b0)))
        return _seconds(flops, fwd_rate), _seconds(ATTENTION_BACKWARD_FACTOR * flops, bwd_rate)

    def calls(self, count: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) seconds of the fixed costs of ``count`` attention calls in one layer
        (a backward call launches ``BACKWARD_KERNELS`` kernels)."""
        forward = np.asarray(count, dtype=np.float64) * self.profile.attention.call_overhead_s
        return forward, BACKWARD_KERNELS * forward
