"""Per-sequence costs: the seconds one sequence adds to each rank it runs on, additive per rank.

This is the step-time model cut per sequence, the pieces a planner's cost model adds up and the
whole-step model (``thdpack.perf.step``) sums: ``whole``, ``split(g)`` (Transformer Engine's
dual-chunk layout over ``g`` ranks, the ring schedule), ``allgather(g)`` and ``a2a(g)``, forward +
backward over every layer. Kernel calls and communication are not per sequence and stay apart
(docs/design/step_model.md, "Per-sequence costs").

Legend: ``S`` sequences, ``G`` ranks of a group.

>>> from thdpack.perf.machine import load_profile
>>> from thdpack.perf.shape import ModelShape
>>> shape = ModelShape(layers=12, hidden=2048, ffn=8192, heads=16, kv_heads=16, head_dim=128, vocab=131072,
...                    gated_mlp=False)
>>> costs = SequenceCosts(load_profile("h100_sxm"), shape)
>>> lengths = np.array([300, 8192])
>>> (costs.attention_whole(lengths) * 1e3).round(3).tolist()             # ms, forward + backward, 12 layers
[0.131, 21.309]
>>> (costs.attention_split(lengths, 4) * 1e3).round(3).tolist()          # per rank of 4: 300 in slivers costs more
[[0.079, 0.079, 0.079, 0.079], [6.012, 6.012, 6.012, 6.012]]
>>> costs.ring_bytes(lengths, 4).tolist()                               # each ring step sends 2c tokens' K and V
[622592.0, 16777216.0]
"""

from __future__ import annotations

import numpy as np

from thdpack.layout.rules import slot_lengths
from thdpack.perf.kernels import KernelTimes
from thdpack.perf.machine import MachineProfile
from thdpack.perf.shape import ModelShape


def split_slot(lengths_S: np.ndarray, group_size: int) -> np.ndarray:
    """(S,) float64 slot of sequences split over ``group_size`` ranks: the length rounded up to a
    multiple of ``2 * group_size`` (TE's rule, ``thdpack.layout.rules.slot_lengths``)."""
    lengths_S = np.asarray(lengths_S, dtype=np.int64)
    return slot_lengths(lengths_S, np.full(lengths_S.shape, group_size)).astype(np.float64)


class SequenceCosts:
    """Per-sequence seconds on one machine for one model (see the module docstring)."""

    def __init__(self, profile: MachineProfile, shape: ModelShape) -> None:
        self.profile, self.shape = profile, shape
        self.kernels = KernelTimes(profile, shape)

    def whole(self, lengths_S: np.ndarray) -> np.ndarray:
        """(S,) seconds of each sequence placed whole on one rank: attention and linear work."""
        return self.attention_whole(lengths_S) + self.kernels.linear(lengths_S)

    def split(self, lengths_S: np.ndarray, group_size: int) -> np.ndarray:
        """(S, G) seconds on each rank of a group of ``group_size`` of each sequence split over it
        (TE's layout, ring schedule): attention compute and the linear work of its ``slot / g``
        tokens. The ring's sends are ``ring_bytes``; per-call costs are not included."""
        share = split_slot(lengths_S, group_size) / group_size
        return self.attention_split(lengths_S, group_size) + self.kernels.linear(share)[:, None]

    def attention_whole(self, lengths_S: np.ndarray) -> np.ndarray:
        """(S,) attention seconds (forward + backward, all layers) of whole sequences."""
        fwd, bwd = self.kernels.causal(np.asarray(lengths_S, dtype=np.float64))
        return self.shape.layers * (fwd + bwd)

    def ring_tiles(self, lengths_S: np.ndarray, group_size: int) -> tuple[np.ndarray, ...]:
        """``(step0_fwd, step0_bwd, later_fwd, later_bwd)``, (S,) each: one layer's seconds of a
        sequence's tile at ring step 0 and at each later step (the same on every rank)."""
        chunk = split_slot(lengths_S, group_size) / (2 * group_size)
        first = self.kernels.causal(2 * chunk)
        later = self.kernels.full(2 * chunk, chunk)
        return first[0], first[1], later[0], later[1]

    def attention_split(self, lengths_S: np.ndarray, group_size: int) -> np.ndarray:
        """(S, G) ring attention compute seconds (forward + backward, all layers) per group rank."""
        if group_size == 1:
            return self.attention_whole(lengths_S)[:, None]
        f0, b0, f1, b1 = self.ring_tiles(lengths_S, group_size)
        per_rank = self.shape.layers * (f0 + b0 + (group_size - 1) * (f1 + b1))
        return np.repeat(per_rank[:, None], group_size, axis=1)

    def allgather_blocks(self, lengths_S: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) one layer's seconds, (S, G) each, of the all-gather layout: group rank
        ``j``'s chunks ``j`` and ``2g-1-j`` against every earlier key of their sequence."""
        g = group_size
        chunk = (split_slot(lengths_S, g) / (2 * g))[:, None]
        ranks = np.arange(g, dtype=np.float64)[None, :]
        diag_f, diag_b = self.kernels.causal(chunk)
        fwd = 2 * diag_f + 0.0 * ranks
        bwd = 2 * diag_b + 0.0 * ranks
        for before in (ranks * chunk, (2 * g - 1 - ranks) * chunk):
            f, b = self.kernels.full(np.broadcast_to(chunk, before.shape), before)
            fwd, bwd = fwd + np.where(before > 0, f, 0.0), bwd + np.where(before > 0, b, 0.0)
        return fwd, bwd

    def attention_allgather(self, lengths_S: np.ndarray, group_size: int) -> np.ndarray:
        """(S, G) all-gather attention compute seconds (forward + backward, all layers) per group rank."""
        fwd, bwd = self.allgather_blocks(lengths_S, group_size)
        return self.shape.layers * (fwd + bwd)

    def attention_a2a(self, lengths_S: np.ndarray, group_size: int) -> np.ndarray:
        """(S,) seconds on every rank of an all-to-all group: each whole sequence for ``1/g`` of the heads."""
        return self.attention_whole(lengths_S) / group_size

    def ring_bytes(self, lengths_S: np.ndarray, group_size: int) -> np.ndarray:
        """(S,) bytes of a split sequence's K and V that each ring step sends (its ``2c`` local tokens)."""
        return split_slot(lengths_S, group_size) / group_size * self.shape.kv_bytes_per_token
