"""The cost models the CP placement minimises: a sequence's attention cost on each rank of its group
(numpy only).

A closed set: ``"tiles"`` (the default: the 128 x 128 kernel tiles a rank's kernels launch, padding
rows included), ``"pairs"`` (the causal (query, key) pairs of real tokens a rank owns) and
``"time"`` (modelled nanoseconds, communication and the host's ops included: a loaded
``SequenceCostModel`` such as ``thdpack.perf.time_cost.TimeCostModel``, which also prices each
group's attention call). docs/design/cp_placement.md (section 6) defines each.

>>> whole_cost(np.array([100, 300]), "tiles").tolist()     # 1 block; 3 blocks: 6 tiles
[1, 6]
>>> split_cost(np.array([1024]), np.array([1024]), 2, "tiles").tolist()   # 10 + 8 on each rank
[[18, 18]]
>>> split_cost(np.array([3]), np.array([4]), 2, "pairs").tolist()   # rank 0: tokens 0 (and pad 3)
[[1, 5]]

Legend: ``S`` sequences (or entries), ``G`` ranks of a group, ``E`` entries of a plan, ``P`` packs,
``R`` ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from thdpack.layout.entries import rank_sums
from thdpack.layout.placement import CpPlacement
from thdpack.layout.rules import cp_multiple, round_up_to_cp, slot_multiple

CostModel = Literal["tiles", "pairs", "time"]
COST_MODELS: tuple[str, ...] = ("tiles", "pairs", "time")
TILE = 128
"""Rows and columns of one kernel tile (FlashAttention-2's block on current GPUs)."""


class SequenceCostModel(Protocol):
    """A cost model given as an object (the loaded ``time`` model): integer costs per sequence,
    every rank of a split sequence's group charged the same."""

    def whole(self, lengths_S: np.ndarray) -> np.ndarray:
        """(S,) int64 cost of each sequence whole on one rank."""
        ...

    def split(self, lengths_S: np.ndarray, slots_S: np.ndarray, group_size: int) -> np.ndarray:
        """(S, G) int64 cost on each rank of a group of ``group_size`` of each sequence split over it."""
        ...

    def call(self, group_size: int) -> tuple[int, int]:
        """``(device, host)`` int64 cost on each rank of one attention call of a group of
        ``group_size`` ranks (1: a rank's local call on its whole sequences)."""
        ...

    def host_lead(self, budget: int) -> int | None:
        """How much longer the host's own part of a round (beside its attention calls) takes than
        the device's (the linear work of ``budget`` tokens), where the host launches ahead of the
        device; None where host and device time add."""
        ...


Costing = CostModel | SequenceCostModel
"""What the planner minimises: a model's name (``"tiles"``, ``"pairs"``) or a loaded model."""


@dataclass(frozen=True)
class CallCosts:
    """A loaded model's per-call costs for one rank budget, and how a rank's device and host time
    combine (``SequenceCostModel.call``, ``.host_lead``)."""

    device: dict[int, int]
    """Group size -> device cost on each rank of one call of a group of that size."""
    host: dict[int, int]
    """Group size -> host cost on each rank of one call."""
    lead: int | None
    """The host's lead over the device beside the calls; None: device and host add."""

    def combine(self, device: np.ndarray, host: np.ndarray) -> np.ndarray:
        """A rank's cost from its device and host costs: ``max(device, host + lead)``, or their sum."""
        if self.lead is None:
            return device + host
        return np.maximum(device, host + self.lead)


def call_costs(cost_model: Costing, sizes: Sequence[int], budget: int) -> CallCosts | None:
    """The call costs of ``cost_model`` for groups of ``sizes`` on ranks of ``budget`` tokens (None
    for tiles and pairs, which count no calls)."""
    if isinstance(cost_model, str):
        return None
    calls = {int(g): cost_model.call(int(g)) for g in sizes}
    return CallCosts(device={g: d for g, (d, _) in calls.items()}, host={g: h for g, (_, h) in calls.items()},
                     lead=cost_model.host_lead(budget))  # fmt: skip


def uniform_split(cost_model: Costing) -> bool:
    """True when a split sequence costs every rank of its group the same (all but ``"pairs"``)."""
    return not (isinstance(cost_model, str) and cost_model == "pairs")


def check_cost_model(cost_model: str) -> None:
    """Raise ``ValueError`` listing the valid models unless ``cost_model`` is one."""
    if cost_model not in COST_MODELS:
        raise ValueError(f"unknown cost_model {cost_model!r}; valid: {', '.join(COST_MODELS)}")


def causal_tiles(n: np.ndarray) -> np.ndarray:
    """Kernel tiles of a causal ``n x n`` block: the lower triangle of ``ceil(n / TILE)`` blocks."""
    blocks = -(-np.asarray(n, dtype=np.int64) // TILE)
    return blocks * (blocks + 1) // 2


def full_tiles(rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Kernel tiles of a full ``rows x cols`` block, elementwise."""
    return -(-np.asarray(rows, dtype=np.int64) // TILE) * (-(-np.asarray(cols, dtype=np.int64) // TILE))


def pairs_below(x: np.ndarray) -> np.ndarray:
    """Causal pairs of the queries at positions ``0 .. x-1`` of one sequence: ``sum(p + 1)``."""
    x = np.asarray(x, dtype=np.int64)
    return x * (x + 1) // 2


def whole_cost(lengths_S: np.ndarray, cost_model: Costing) -> np.ndarray:
    """(S,) int64 cost of each sequence placed whole on one rank (no CP padding)."""
    if not isinstance(cost_model, str):
        return cost_model.whole(np.asarray(lengths_S, dtype=np.int64))
    if cost_model == "tiles":
        return causal_tiles(lengths_S)
    return pairs_below(lengths_S)


def split_cost(lengths_S: np.ndarray, slots_S: np.ndarray, group_size: int, cost_model: Costing) -> np.ndarray:
    """(S, G) int64 cost on each rank ``j`` of a group of ``G = group_size`` ranks of every
    sequence split over it in the dual-chunk layout: rank ``j`` holds chunks ``j`` and
    ``2G-1-j`` of the sequence's slot.

    Args:
        lengths_S: (S,) real tokens of each sequence.
        slots_S: (S,) padded slot of each sequence, a multiple of ``2 * group_size``, ``>= lengths_S``.
        group_size: ranks of the group (>= 1).
        cost_model: ``"tiles"`` (the same on every rank of the group), ``"pairs"`` or a loaded model.
    """
    lengths_S = np.asarray(lengths_S, dtype=np.int64)
    if not isinstance(cost_model, str):
        return cost_model.split(lengths_S, np.asarray(slots_S, dtype=np.int64), group_size)
    if cost_model == "tiles":
        return np.repeat(split_tiles(slots_S, group_size)[:, None], group_size, axis=1)
    chunks = slot_multiple(group_size)
    chunk_S = np.asarray(slots_S, dtype=np.int64) // chunks
    ranks_G = np.arange(group_size)
    cost_SG = np.zeros((len(lengths_S), group_size), dtype=np.int64)
    for first_SG in (ranks_G * chunk_S[:, None], (chunks - 1 - ranks_G) * chunk_S[:, None]):
        start_SG = np.minimum(first_SG, lengths_S[:, None])
        stop_SG = np.minimum(first_SG + chunk_S[:, None], lengths_S[:, None])
        cost_SG += pairs_below(stop_SG) - pairs_below(start_SG)
    return cost_SG


def split_tiles(slots_S: np.ndarray, group_size_S: np.ndarray | int) -> np.ndarray:
    """(S,) int64 tiles every rank of a sequence's group runs for it under the ring schedule
    (``split_cost``'s tiles, one value per sequence; group sizes may differ per sequence)."""
    group_size_S = np.asarray(group_size_S, dtype=np.int64)
    chunk_S = np.asarray(slots_S, dtype=np.int64) // slot_multiple(group_size_S)
    # step 0: the causal tile of the rank's two chunks; each later step: 2 chunks x 1 chunk
    return causal_tiles(2 * chunk_S) + (group_size_S - 1) * full_tiles(2 * chunk_S, chunk_S)


def rank_costs(placement: CpPlacement, cost_model: Costing = "tiles") -> np.ndarray:
    """(P, R) int64 attention cost of each rank in each pack of ``placement`` under ``cost_model``.

    >>> te = CpPlacement.all_split(np.array([0, 1]), np.array([1024]), cp_size=2, pack_size=1024)
    >>> rank_costs(te).tolist()        # split_cost's 10 + 8 tiles on each rank
    [[18, 18]]
    """
    pack_E, slots = placement.pack_of_entry(), placement.slots()
    num_packs, cp_size = len(placement), placement.cp_size
    lengths, group_size, group_start = placement.lengths, placement.group_size, placement.group_start
    whole = group_size == 1
    if cost_model == "tiles":  # a split sequence costs every rank of its group the same
        value = np.where(whole, causal_tiles(lengths), split_tiles(slots, group_size))
        return rank_sums(pack_E, value, group_start, group_size, num_packs, cp_size)
    if uniform_split(cost_model):
        value = whole_cost(lengths, cost_model)
        for g in np.unique(group_size[~whole]).tolist():
            of_g = group_size == g
            value[of_g] = split_cost(lengths[of_g], slots[of_g], g, cost_model)[:, 0]
        cost_PR = rank_sums(pack_E, value, group_start, group_size, num_packs, cp_size)
        calls = call_costs(cost_model, np.unique(group_size).tolist(), placement.pack_size // cp_size)
        if calls is None:
            return cost_PR
        # one call per group of each pack on each of its ranks, however many sequences it attends
        key = (pack_E * (cp_size + 1) + group_size) * cp_size + group_start
        pack_G, rest = np.divmod(np.unique(key), (cp_size + 1) * cp_size)
        size_G, start_G = np.divmod(rest, cp_size)
        device_G, host_G = (np.array([costs[g] for g in size_G.tolist()], dtype=np.int64).reshape(-1)
                            for costs in (calls.device, calls.host))  # fmt: skip
        device_PR = cost_PR + rank_sums(pack_G, device_G, start_G, size_G, num_packs, cp_size)
        return calls.combine(device_PR, rank_sums(pack_G, host_G, start_G, size_G, num_packs, cp_size))
    one = np.ones(len(lengths), dtype=np.int64)
    cost_PR = rank_sums(
        pack_E[whole], whole_cost(lengths[whole], cost_model), group_start[whole], one[whole], num_packs, cp_size
    )
    for g in np.unique(group_size[~whole]).tolist():
        of_g = np.flatnonzero(group_size == g)
        cost_EG = split_cost(lengths[of_g], slots[of_g], g, cost_model)
        for j in range(g):
            cost_PR += rank_sums(pack_E[of_g], cost_EG[:, j], group_start[of_g] + j, one[of_g], num_packs, cp_size)
    return cost_PR


def whole_limit(cp_size: int, cost_model: Costing) -> int:
    """The longest length ``m`` such that every sequence of at most ``m`` tokens costs no more
    placed whole on one rank than on ANY rank under Transformer Engine's layout over ``cp_size``
    ranks (0 when no length qualifies).

    Sequences this short are never split by the adaptive planner and take no CP padding, and a
    rank's whole sequences of this kind then cost it no more than TE's layout of the same sequences
    costs every rank (the per-pack guarantee of ``thdpack.plan.adaptive`` rests on it). Tiles: a
    split sequence costs every rank at least one tile per ring step (``cp_size`` tiles), so the
    limit is the longest length whose causal block triangle has at most ``cp_size`` tiles while its
    chunks stay within one tile; pairs: 0 (a rank that owns none of a short sequence's tokens
    under TE pays nothing for it).

    >>> [whole_limit(cp, "tiles") for cp in (1, 2, 3, 4, 8, 16)]
    [0, 128, 256, 256, 384, 640]
    >>> whole_limit(8, "pairs")
    0
    """
    if cp_size < 2:
        return 0
    m = np.arange(1, TILE * cp_multiple(cp_size) + 1, dtype=np.int64)  # chunks of at most one tile
    te_min = split_cost(m, round_up_to_cp(m, cp_size), cp_size, cost_model).min(axis=1)
    worse = whole_cost(m, cost_model) > te_min
    return int(np.argmax(worse)) if worse.any() else int(m[-1])
