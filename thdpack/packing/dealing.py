"""The data-parallel dealer: every epoch's plan and pack order, and how the packs reach the ranks.

This module alone decides which packs a data-parallel rank sees. Epoch ``e`` is planned and its
packs ordered with seeds derived from ``(seed, e)`` (:class:`Epochs`), so every rank computes the
same order without communicating; the rest of an epoch is planned again from the pieces not yet
consumed when a run resumes with other settings (:meth:`Epochs.rest`). The packs then reach the
ranks as balanced steps (:func:`deal`, the trainer's stream), a map-style share
(:func:`rank_share`, ``PackedDataset[i]``) or round robin (:func:`round_robin`). ``deal`` balances
attention cost, not tokens: nearly full packs hold the same tokens, but one 4096-token sequence
costs sixteen times the attention of sixteen 256-token ones, and a step waits for its slowest rank.

>>> costs = pack_costs([np.array([8]), np.array([2, 2, 2, 2]), np.array([4, 4]), np.array([8])], "attention")
>>> deal(costs, num_ranks=2)
[[0, 2], [3, 1]]
>>> [hand.tolist() for hand in round_robin(np.arange(5), 2)]
[[0, 2, 4], [1, 3]]
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np

from thdpack.packing.pieces import Pieces
from thdpack.plan.api import plan_with
from thdpack.plan.auto import PlanTiming
from thdpack.plan.config import PlanConfig
from thdpack.plan.packplan import PackPlan

log = logging.getLogger(__name__)

Remainder = Literal["repeat", "drop"]
REMAINDERS: tuple[str, ...] = get_args(Remainder)
Balance = Literal["attention", "tokens", "none"]
BALANCES: tuple[str, ...] = get_args(Balance)


# -- the epochs ----------------------------------------------------------------------------


def epoch_seeds(seed: int | None, epoch: int, replans: int = 0) -> tuple[int | None, int]:
    """(plan seed, order seed) of ``epoch``: independent streams derived from ``(seed, epoch)``, and
    from ``(seed, epoch, replans)`` for the rest of the epoch planned again the ``replans``-th time.

    ``seed=None`` keeps the planner deterministic (the same plan every epoch); the order is then
    shuffled by a seed derived from the epoch alone.
    """
    tail = [replans] if replans else []
    if seed is None:
        return None, int(np.random.SeedSequence([epoch, *tail]).generate_state(1)[0])
    plan_seed, order_seed = np.random.SeedSequence([seed, epoch, *tail]).generate_state(2)
    return int(plan_seed), int(order_seed)


def plan_epoch(
    lengths: np.ndarray, config: PlanConfig, *, cp_size: int, epoch: int, timing: PlanTiming | None = None
) -> PackPlan:
    """Epoch ``epoch``'s plan: ``config`` with the plan seed derived from ``(config.seed, epoch)``
    (``timing``: a timed plan's, ``plan_with``)."""
    plan_seed, _ = epoch_seeds(config.seed, epoch)
    return plan_with(lengths, dataclasses.replace(config, seed=plan_seed), cp_size=cp_size, timing=timing)


@dataclass(frozen=True)
class Epoch:
    """One epoch: its plan and the order of all its packs (every rank's).

    A run resumed with other plan settings continues the epoch with the plan of its rest
    (``Epochs.rest``): then ``consumed_before`` holds the pieces of its sequences consumed before
    that plan, and ``items`` what the plan was made over (the other pieces).
    """

    number: int
    plan: PackPlan
    order: np.ndarray
    """(P,) pack indices of the plan in the epoch's (shuffled) order."""
    replans: int = 0
    """How many times the rest of the epoch was planned again (0: the epoch's own plan)."""
    consumed_before: Pieces | None = None
    """The pieces of the epoch's sequences consumed before this plan was made (None: none, the
    epoch's own plan)."""
    items: Pieces | None = None
    """The pieces this plan was made over (None: every sequence whole)."""

    def __len__(self) -> int:
        return len(self.order)

    def segments(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``plan.segments`` of the pack at ``index`` of the order."""
        return self.plan.segments(int(self.order[index]))

    def consumed(self, packs: int) -> Pieces:
        """The pieces of the epoch's sequences consumed once the first ``packs`` packs of the order
        are trained: ``consumed_before``, every entry of those packs and, where the plan cut a
        sequence short (``overflow="truncate"``), the cut-off rest of each piece whose entry was
        trained (the epoch does not train it). ``ValueError`` when a token would be consumed twice.

        >>> plan = PackPlan(np.array([1, 0, 2]), np.array([0, 1, 3]), sequence_lengths=np.array([3, 5, 4]),
        ...                 pack_size=8, cp_size=1, algorithm="bfd", seed=None, stats=None)
        >>> done = Epoch(number=0, plan=plan, order=np.array([1, 0])).consumed(1)   # pack 1: sequences 0 and 2
        >>> done.sample.tolist(), done.length.tolist()
        ([0, 2], [3, 4])
        """
        plan = self.plan
        trained = plan_pieces(plan, self.order[:packs])
        if plan.entry_lengths is not None and len(trained):  # entries may be cut: a truncated rest is consumed too
            items = self.items if self.items is not None else Pieces.whole(plan.sequence_lengths)
            cut = items.minus(plan_pieces(plan, np.arange(len(plan))))
            touched = np.isin(items.owners(cut), items.owners(trained))
            trained = trained.union(cut.select(touched))
        return trained if self.consumed_before is None else self.consumed_before.union(trained)


def plan_pieces(plan: PackPlan, packs: np.ndarray) -> Pieces:
    """The pieces of the sequences that the packs ``packs`` of ``plan`` hold (its entries)."""
    packs = np.asarray(packs, dtype=np.int64)
    first = plan.offsets[packs]
    counts = plan.offsets[packs + 1] - first
    entry = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(first - (np.cumsum(counts) - counts), counts)
    sample = plan.indices[entry]
    start = np.zeros(len(entry), dtype=np.int64) if plan.entry_starts is None else plan.entry_starts[entry]
    length = plan.sequence_lengths[sample] if plan.entry_lengths is None else plan.entry_lengths[entry]
    return Pieces.of(sample, start, length)


def plan_on_sequences(plan: PackPlan, items: Pieces, lengths_S: np.ndarray) -> PackPlan:
    """``plan``, made over the pieces ``items`` (its entry ``j`` is of piece ``plan.indices[j]``),
    as a plan over the pieces' sequences (of lengths ``lengths_S``): the same packs, each entry
    the tokens of its sequence it holds."""
    item = plan.indices
    inside = np.zeros(len(item), dtype=np.int64) if plan.entry_starts is None else plan.entry_starts
    return plan.replace(
        indices=items.sample[item],
        sequence_lengths=lengths_S,
        entry_starts=items.start[item] + inside,
        entry_lengths=items.length[item] if plan.entry_lengths is None else plan.entry_lengths,
    )


class Epochs:
    """Every epoch's plan and pack order over ``lengths`` (checked: ``thdpack.plan.api.as_lengths``),
    each planned once.

    The two most recent epochs are kept, so a consumer whose step straddles an epoch boundary
    reads both without re-planning either. ``first_plan``: epoch 0's plan made beforehand (a
    prepared store's ``plan.npz``); it must be exactly what epoch 0 would plan.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        config: PlanConfig,
        *,
        cp_size: int,
        shuffle: bool,
        first_plan: PackPlan | None = None,
        timing: PlanTiming | None = None,
    ) -> None:
        self.lengths = lengths
        self.config, self.cp_size, self.shuffle = config, cp_size, shuffle
        self.timing = timing
        self._epochs: dict[int, Epoch] = {}
        self.plans_made = 0
        """How many epoch plans were computed (each epoch once; a given first plan is not one)."""
        if first_plan is not None:
            self._check_first_plan(first_plan)
            self._epochs[0] = self._order(0, first_plan)

    def __getitem__(self, epoch: int) -> Epoch:
        found = self._epochs.get(epoch)
        if found is None:
            self.plans_made += 1
            plan = plan_epoch(self.lengths, self.config, cp_size=self.cp_size, epoch=epoch, timing=self.timing)
            found = self._order(epoch, plan)
            log.debug("epoch %d plan:\n%s", epoch, found.plan.stats)
            self._epochs[epoch] = found
            while len(self._epochs) > 2:
                self._epochs.pop(min(self._epochs))
        return found

    def _order(self, epoch: int, plan: PackPlan) -> Epoch:
        return Epoch(number=epoch, plan=plan, order=self._shuffled(len(plan), epoch_seeds(self.config.seed, epoch)[1]))

    def _shuffled(self, packs: int, order_seed: int) -> np.ndarray:
        return np.random.default_rng(order_seed).permutation(packs) if self.shuffle else np.arange(packs)

    def rest(self, number: int, consumed: Pieces, *, replans: int) -> Epoch | None:
        """Epoch ``number``'s pieces not in ``consumed``, planned with these settings as the
        epoch's ``replans``-th re-plan (seeds derived from ``(seed, number, replans)``, so every
        rank, and a run resumed with the same settings, plans the same); None when nothing is left.
        Sequences whole in the rest are planned as sequences, the rest of a sequence cut by the
        consumed pieces as a sequence of its own (the packer takes its labels from the sequence)."""
        items = Pieces.whole(self.lengths).minus(consumed)
        if not len(items):
            return None
        plan_seed, order_seed = epoch_seeds(self.config.seed, number, replans)
        config = dataclasses.replace(self.config, seed=plan_seed)
        over_items = plan_with(items.length, config, cp_size=self.cp_size, timing=self.timing)
        self.plans_made += 1
        plan = plan_on_sequences(over_items, items, self.lengths)
        order = self._shuffled(len(plan), order_seed)
        return Epoch(number=number, plan=plan, order=order, replans=replans, consumed_before=consumed, items=items)

    def _check_first_plan(self, plan: PackPlan) -> None:
        want = {
            "pack_size": self.config.pack_size,
            "cp_size": self.cp_size,
            "algorithm": self.config.algorithm,
            "seed": epoch_seeds(self.config.seed, 0)[0],
        }
        got = {key: getattr(plan, key) for key in want}
        diff = [f"{key}: plan {got[key]!r}, epoch 0 {want[key]!r}" for key in want if got[key] != want[key]]
        if not np.array_equal(plan.sequence_lengths, self.lengths):
            diff.append(f"lengths: the plan's {len(plan.sequence_lengths):,}, the data's {len(self.lengths):,}")
        if diff:
            raise ValueError(f"the given plan is not what epoch 0 plans ({'; '.join(diff)}); let the epoch re-plan")

    def fingerprint(self) -> dict[str, Any]:
        """The settings that decide every epoch's packs and their order (a timed plan's: the digest of
        its timing, what the profile and model shape hold on the run's nodes)."""
        out = {
            **self.config.fingerprint(),
            "cp_size": self.cp_size,
            "shuffle": self.shuffle,
            "num_sequences": len(self.lengths),
        }
        if self.config.timed and self.timing is not None:
            out["timing_sha256"] = self.timing.digest()
        return out


# -- the map-style share -------------------------------------------------------------------


@dataclass(frozen=True)
class EpochShard:
    """How one epoch's packs were dealt round robin to the data-parallel ranks."""

    epoch: int
    num_packs: int
    """Packs in the epoch's plan (all ranks together)."""
    packs_per_rank: int
    repeated_packs: int
    """Packs seen twice in the epoch to even out the ranks (remainder="repeat")."""
    dropped_packs: int
    """Packs no rank sees in the epoch (remainder="drop")."""
    dropped_tokens: int
    """Real tokens of the dropped packs."""


def round_robin(items: np.ndarray, hands: int) -> list[np.ndarray]:
    """``items`` dealt like cards: hand ``h`` gets ``items[h], items[h + hands], ...``."""
    return [items[h::hands] for h in range(hands)]


def rank_share(epoch: Epoch, *, rank: int, world_size: int, remainder: Remainder) -> tuple[np.ndarray, EpochShard]:
    """``rank``'s packs (indices into ``epoch.order``) when the order is dealt round robin to
    ``world_size`` ranks, every rank the same number: ``"repeat"`` (like ``DistributedSampler``)
    repeats the first packs of the order to fill the last round, ``"drop"`` leaves the last few
    out (a ``ValueError`` when some rank would get none). What it repeats or drops is logged.

    >>> plan = PackPlan(np.arange(5), np.arange(6), sequence_lengths=np.ones(5, dtype=np.int64),
    ...                 pack_size=1, cp_size=1, algorithm="bfd", seed=None, stats=None)
    >>> epoch = Epoch(number=0, plan=plan, order=np.arange(5))
    >>> mine, shard = rank_share(epoch, rank=1, world_size=2, remainder="repeat")
    >>> mine.tolist(), shard.repeated_packs
    ([1, 3, 0], 1)
    """
    n = len(epoch)
    positions = np.arange(n)
    if remainder == "repeat":
        per_rank = -(-n // world_size)
        dealt = np.resize(positions, per_rank * world_size)  # np.resize repeats the order cyclically
        dropped = positions[:0]
    else:
        per_rank = n // world_size
        if per_rank == 0:
            raise ValueError(
                f"epoch {epoch.number} has {n} packs for dp_size={world_size} ranks: with remainder='drop' some "
                "ranks would get none; use remainder='repeat', a smaller pack_size or fewer ranks"
            )
        dealt, dropped = positions[: per_rank * world_size], positions[per_rank * world_size :]
    shard = EpochShard(
        epoch=epoch.number,
        num_packs=n,
        packs_per_rank=per_rank,
        repeated_packs=per_rank * world_size - n if remainder == "repeat" else 0,
        dropped_packs=len(dropped),
        dropped_tokens=sum(int(epoch.segments(int(i))[2].sum()) for i in dropped),
    )
    if shard.dropped_packs:
        log.warning(
            "epoch %d: %d of %d packs (%d tokens) dropped to give %d ranks %d packs each (remainder='drop')",
            epoch.number,
            shard.dropped_packs,
            n,
            shard.dropped_tokens,
            world_size,
            per_rank,
        )
    elif shard.repeated_packs:
        log.info(
            "epoch %d: %d packs repeated to give %d ranks %d packs each (remainder='repeat')",
            epoch.number,
            shard.repeated_packs,
            world_size,
            per_rank,
        )
    return round_robin(dealt, world_size)[rank], shard


# -- balanced steps ------------------------------------------------------------------------


def pack_costs(pack_lengths: list[np.ndarray], balance: Balance) -> np.ndarray:
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
