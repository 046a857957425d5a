"""Deal a step's packs to data-parallel ranks so that every rank carries the same work.

Packs are nearly full, so token counts hardly differ; attention cost does: a pack holding one
4096-token sequence costs 4096^2 in attention, one holding sixteen 256-token sequences 16 x 256^2,
sixteen times less. The step waits for its slowest rank, so packs are dealt by cost, largest
first, each to the least-loaded rank that still takes packs (every rank gets the same count).

>>> costs = pack_costs([np.array([8]), np.array([2, 2, 2, 2]), np.array([4, 4]), np.array([8])], "attention")
>>> deal(costs, num_ranks=2)
[[0, 2], [3, 1]]
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


def pack_costs(pack_lengths: list[np.ndarray], balance: str) -> np.ndarray:
    """(P,) float64 cost of each pack: tokens + attention (sum of squared lengths / max length)
    for ``"attention"``, tokens for ``"tokens"``, zeros for ``"none"`` (keeps the order)."""
    tokens = np.array([float(lengths.sum()) for lengths in pack_lengths])
    if balance == "none":
        return np.zeros(len(pack_lengths))
    if balance == "tokens":
        return tokens
    # attention FLOPs ~ sum L^2; scale them to tokens so neither term drowns the other
    squares = np.array([float((lengths.astype(np.float64) ** 2).sum()) for lengths in pack_lengths])
    longest = max(1.0, max(float(lengths.max()) for lengths in pack_lengths))
    return tokens + squares / longest


def deal(costs: np.ndarray, num_ranks: int) -> list[list[int]]:
    """Pack indices per rank, ``len(costs) / num_ranks`` each, largest cost first to the least
    loaded rank (ties: lowest rank). Equal costs keep the packs' order (round robin)."""
    if len(costs) % num_ranks:
        raise ValueError(f"{len(costs)} packs cannot be dealt evenly to {num_ranks} ranks")
    per_rank = len(costs) // num_ranks
    hands: list[list[int]] = [[] for _ in range(num_ranks)]
    heap = [(0.0, r) for r in range(num_ranks)]
    for i in np.argsort(-costs, kind="stable").tolist():
        load, r = heapq.heappop(heap)
        hands[r].append(i)
        if len(hands[r]) < per_rank:
            heapq.heappush(heap, (load + float(costs[i]), r))
    return hands


@dataclass(frozen=True)
class Imbalance:
    """max / mean over ranks of a step's work (1.0 = perfectly balanced)."""

    tokens: float
    attention: float


def imbalance(pack_lengths: list[np.ndarray], hands: list[list[int]]) -> Imbalance:
    """How uneven the dealt step is, in tokens and in attention cost (sum of squared lengths)."""
    tokens = np.array([sum(float(pack_lengths[i].sum()) for i in hand) for hand in hands])
    squares = np.array([sum(float((pack_lengths[i].astype(np.float64) ** 2).sum()) for i in hand) for hand in hands])

    def ratio(x: np.ndarray) -> float:
        return float(x.max() / x.mean()) if x.mean() > 0 else 1.0

    return Imbalance(tokens=ratio(tokens), attention=ratio(squares))
