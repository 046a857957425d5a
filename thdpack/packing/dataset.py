"""PackedDataset: a map-style dataset of packs, planned over sequence lengths, built on the fly.

The dataset holds a plan (index arrays, a few bytes per sequence) and builds pack ``i`` when
asked, so host memory stays proportional to one pack. Every epoch is re-planned with a seed
derived from ``(seed, epoch)``: for ``"bfd"`` / ``"ffd"`` which sequences share a pack changes
from epoch to epoch, and the pack order of the epoch is shuffled by the same seed. Same seed,
same epoch -> the same packs in the same order, on every machine.

Data parallelism: with ``world_size > 1`` each rank sees a disjoint, interleaved slice of the
epoch's packs, and every rank the same number. When the packs do not divide evenly,
``remainder="repeat"`` (default, like ``DistributedSampler``) repeats the first packs of the
epoch's order to fill the last round; ``remainder="drop"`` leaves the last few out. Either way
``epoch_shard`` reports how many packs (and, for drop, tokens) it took, and it is logged.

>>> samples = [{"input_ids": list(range(1, n + 1))} for n in (3, 5, 2, 6, 4)]
>>> ds = PackedDataset(samples, 8, algorithm="sequential", shuffle=False)
>>> len(ds), ds.stats.num_packs
(3, 3)
>>> ds[0]["input_ids"].tolist(), ds[0]["seq_lens"].tolist(), ds[0]["seq_lens_padded"].tolist()
([1, 2, 3, 1, 2, 3, 4, 5], [3, 5], [3, 5])
>>> ds[1]["input_ids"].tolist(), ds[1]["position_ids"].tolist()
([1, 2, 1, 2, 3, 4, 5, 6], [0, 1, 0, 1, 2, 3, 4, 5])
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np
import torch

from thdpack.packing import layout
from thdpack.packing.packer import Pack, build_pack, read_sample
from thdpack.packing.state import check_saved_settings, settings_fingerprint
from thdpack.plan import (
    ALGORITHMS,
    DEFAULT_WINDOW,
    OVERFLOWS,
    Algorithm,
    Overflow,
    PackingStats,
    PackPlan,
    as_lengths,
    plan_packs,
)

if TYPE_CHECKING:
    from thdpack.packing.steps import StepStream

log = logging.getLogger(__name__)

Remainder = Literal["repeat", "drop"]
REMAINDERS: tuple[str, ...] = ("repeat", "drop")
Balance = Literal["attention", "tokens", "none"]
BALANCES: tuple[str, ...] = get_args(Balance)


@dataclass(frozen=True, kw_only=True)
class PackedDatasetConfig:
    """Settings of a ``PackedDataset``."""

    pack_size: int
    """Tokens per pack (a multiple of 2*cp_size when cp_size > 1)."""
    cp_size: int = 1
    """Context-parallel size: every sequence is padded to a multiple of 2*cp_size."""
    algorithm: Algorithm = "bfd"
    """Planner: "bfd", "ffd", "sequential" (NeMo's order-preserving next fit) or "window"."""
    overflow: Overflow = "error"
    """Sequences longer than pack_size: "error", "drop", "truncate" or "split" (counted in stats)."""
    seed: int = 0
    """Base seed; epoch e plans and shuffles with a seed derived from (seed, e)."""
    pad_id: int = 0
    """Token id of padding (its label is always -100)."""
    shuffle: bool = True
    """Shuffle the pack order of every epoch (bfd/ffd plans come largest-first otherwise)."""
    rank: int = 0
    """Data-parallel rank of this process."""
    world_size: int = 1
    """Data-parallel world size."""
    remainder: Remainder = "repeat"
    """Packs left over when world_size does not divide them: "repeat" packs or "drop" them."""
    window: int = DEFAULT_WINDOW
    """Lookahead of algorithm="window" (sequences it may reorder across)."""
    balance: Balance = "attention"
    """How ``step_stream`` deals each step's packs to the data-parallel ranks: balancing attention
    cost and tokens ("attention"), tokens only ("tokens"), or in order ("none")."""

    def __post_init__(self) -> None:
        for name in ("pack_size", "cp_size", "world_size", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("seed", "rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if isinstance(self.pad_id, bool) or not isinstance(self.pad_id, int):
            raise TypeError(f"pad_id must be an integer token id, got {self.pad_id!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algorithm!r}; valid: {', '.join(ALGORITHMS)}")
        if self.overflow not in OVERFLOWS:
            raise ValueError(f"unknown overflow policy {self.overflow!r}; valid: {', '.join(OVERFLOWS)}")
        if self.balance not in BALANCES:
            raise ValueError(f"unknown balance {self.balance!r}; valid: {', '.join(BALANCES)}")
        if self.remainder not in REMAINDERS:
            raise ValueError(f"unknown remainder policy {self.remainder!r}; valid: {', '.join(REMAINDERS)}")
        if self.rank >= self.world_size:
            raise ValueError(f"rank={self.rank} must be < world_size={self.world_size}")
        layout.check_pack_size(self.pack_size, self.cp_size)


@dataclass(frozen=True)
class EpochView:
    """One epoch: its plan, the order of all its packs, and this rank's interleaved share."""

    plan: PackPlan
    order: np.ndarray
    """(P,) pack indices of the plan in the epoch's (shuffled) order: all ranks' packs."""
    mine: np.ndarray
    """This rank's packs, ``order`` dealt round robin (what ``ds[i]`` / ``iter(ds)`` serve)."""
    shard: EpochShard


@dataclass(frozen=True)
class EpochShard:
    """How one epoch's packs were dealt to the data-parallel ranks."""

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


def epoch_seeds(seed: int, epoch: int) -> tuple[int, int]:
    """(plan seed, order seed) of ``epoch``: independent streams derived from ``(seed, epoch)``."""
    plan_seed, order_seed = np.random.SeedSequence([seed, epoch]).generate_state(2)
    return int(plan_seed), int(order_seed)


class PackedDataset(torch.utils.data.Dataset):
    """Packs of ``samples`` (mappings with ``input_ids``, optional ``labels`` / ``loss_mask``).

    ``ds[i]`` builds pack ``i`` of this rank's share of the current epoch (a ``Pack``: int64
    tensors ``input_ids``, ``labels``, ``position_ids`` of length pack_size, ``seq_lens``,
    ``seq_lens_padded``). ``iter(ds)`` yields the rest of the epoch from the saved position
    and then moves on to the next epoch; ``state_dict()`` captures epoch, seed and position.
    ``lengths`` (one per sample) saves a pass over the samples; they are checked as packs are
    built. The number of packs can differ between epochs with bfd/ffd re-planning.

    Batch packs with ``thdpack.collate`` (or ``thdpack.compat.nemo.packed_sequence_thd_collater``):
    ``seq_lens`` differ in length from pack to pack, so torch's default collate cannot stack them.
    With a ``DataLoader`` the sampler decides the order of ``ds[i]``; ``state_dict()`` then still
    carries epoch and seed, and the loader (e.g. torchdata's ``StatefulDataLoader``) its position.
    """

    def __init__(
        self,
        samples: Sequence[Mapping[str, Any]],
        pack_size: int,
        *,
        cp_size: int = 1,
        algorithm: Algorithm = "bfd",
        overflow: Overflow = "error",
        seed: int = 0,
        pad_id: int = 0,
        lengths: Sequence[int] | np.ndarray | None = None,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        remainder: Remainder = "repeat",
        window: int = DEFAULT_WINDOW,
        balance: Balance = "attention",
    ) -> None:
        self.config = PackedDatasetConfig(
            pack_size=pack_size,
            cp_size=cp_size,
            algorithm=algorithm,
            overflow=overflow,
            seed=seed,
            pad_id=pad_id,
            shuffle=shuffle,
            rank=rank,
            world_size=world_size,
            remainder=remainder,
            window=window,
            balance=balance,
        )
        self.samples = samples
        if lengths is None:
            lengths = [len(read_sample(samples[i], i)) for i in range(len(samples))]
        self.lengths = as_lengths(lengths)
        if len(self.lengths) != len(samples):
            raise ValueError(f"got {len(self.lengths)} lengths for {len(samples)} samples; give one per sample")
        self._epoch = 0
        self._position = 0
        self._views: dict[int, EpochView] = {}
        self.plans_made = 0
        """How many epoch plans this dataset computed (each epoch once)."""
        log.debug("PackedDataset epoch 0 plan:\n%s", self.stats)

    @classmethod
    def from_config(
        cls,
        samples: Sequence[Mapping[str, Any]],
        config: PackedDatasetConfig,
        *,
        lengths: Sequence[int] | np.ndarray | None = None,
    ) -> PackedDataset:
        """The dataset of ``samples`` with the settings of ``config`` (what the trainer's Hydra
        ``packing`` group builds)."""
        fields = settings_fingerprint(config, exclude=("pack_size",))
        return cls(samples, config.pack_size, lengths=lengths, **fields)

    # -- the epoch's plan and order ---------------------------------------------------------
    def epoch_view(self, epoch: int | None = None) -> EpochView:
        """Epoch ``epoch``'s plan, its pack order and this rank's share (default: the current epoch).

        Planned once per epoch: the two most recent epochs are kept, so a consumer whose step
        straddles an epoch boundary reads both without re-planning either."""
        epoch = self._epoch if epoch is None else epoch
        view = self._views.get(epoch)
        if view is None:
            self.plans_made += 1
            view = self._plan_epoch(epoch)
            self._views[epoch] = view
            while len(self._views) > 2:
                self._views.pop(min(self._views))
        return view

    def _epoch_view(self) -> tuple[PackPlan, np.ndarray, EpochShard]:
        view = self.epoch_view()
        return view.plan, view.mine, view.shard

    def _plan_epoch(self, epoch: int) -> EpochView:
        cfg = self.config
        plan_seed, order_seed = epoch_seeds(cfg.seed, epoch)
        plan = plan_packs(
            self.lengths,
            cfg.pack_size,
            algorithm=cfg.algorithm,
            cp_size=cfg.cp_size,
            overflow=cfg.overflow,
            seed=plan_seed,
            window=cfg.window,
        )
        n, world = len(plan), cfg.world_size
        order = np.random.default_rng(order_seed).permutation(n) if cfg.shuffle else np.arange(n)
        if cfg.remainder == "repeat":
            per_rank = -(-n // world)
            dealt = np.resize(order, per_rank * world)  # np.resize repeats the order cyclically
            dropped = np.zeros(0, dtype=np.int64)
        else:
            per_rank = n // world
            if per_rank == 0:
                raise ValueError(
                    f"epoch {epoch} has {n} packs for world_size={world}: with remainder='drop' some "
                    "ranks would get none; use remainder='repeat', a smaller pack_size or fewer ranks"
                )
            dealt, dropped = order[: per_rank * world], order[per_rank * world :]
        shard = EpochShard(
            epoch=epoch,
            num_packs=n,
            packs_per_rank=per_rank,
            repeated_packs=per_rank * world - n if cfg.remainder == "repeat" else 0,
            dropped_packs=len(dropped),
            dropped_tokens=sum(int(plan.segments(int(i))[2].sum()) for i in dropped),
        )
        if shard.dropped_packs:
            log.warning(
                "epoch %d: %d of %d packs (%d tokens) dropped to give %d ranks %d packs each (remainder='drop')",
                epoch,
                shard.dropped_packs,
                n,
                shard.dropped_tokens,
                world,
                per_rank,
            )
        elif shard.repeated_packs:
            log.info(
                "epoch %d: %d packs repeated to give %d ranks %d packs each (remainder='repeat')",
                epoch,
                shard.repeated_packs,
                world,
                per_rank,
            )
        return EpochView(plan=plan, order=order, mine=dealt[cfg.rank :: world], shard=shard)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def plan(self) -> PackPlan:
        """The current epoch's plan (all ranks' packs)."""
        return self._epoch_view()[0]

    @property
    def stats(self) -> PackingStats:
        """The current epoch's ``PackingStats`` (what overflow dropped / truncated / split included)."""
        return self.plan.stats

    @property
    def epoch_shard(self) -> EpochShard:
        """How the current epoch was dealt to the ranks (repeated / dropped packs)."""
        return self._epoch_view()[2]

    def set_epoch(self, epoch: int) -> None:
        """Switch to ``epoch`` (re-plans lazily); the position restarts unless it is the current epoch,
        so calling ``set_epoch`` with the resumed epoch keeps a restored position."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        if epoch != self._epoch:
            self._epoch, self._position = epoch, 0

    # -- map-style access ----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._epoch_view()[1])

    def __getitem__(self, i: int) -> Pack:
        plan, order, _ = self._epoch_view()
        n = len(order)
        if not -n <= i < n:
            raise IndexError(f"pack {i} out of range: this rank has {n} packs in epoch {self._epoch}")
        cfg = self.config
        return build_pack(
            self.samples,
            plan.segments(int(order[i])),
            cfg.pack_size,
            cp_size=cfg.cp_size,
            pad_id=cfg.pad_id,
            sample_lengths=self.lengths,
        )

    def epoch_pack(self, epoch: int, index: int) -> Pack:
        """Pack ``index`` of epoch ``epoch``'s whole order (all ranks' packs; ``step_stream`` deals them)."""
        view = self.epoch_view(epoch)
        cfg = self.config
        return build_pack(
            self.samples,
            view.plan.segments(int(view.order[index])),
            cfg.pack_size,
            cp_size=cfg.cp_size,
            pad_id=cfg.pad_id,
            sample_lengths=self.lengths,
        )

    def step_stream(self, *, micro_batches: int, packs_per_micro_batch: int) -> StepStream:
        """Optimizer steps over every epoch's packs, dealt to this dataset's data-parallel rank
        (``rank`` of ``world_size``) by ``balance``: :class:`thdpack.packing.steps.StepStream`."""
        from thdpack.packing.steps import StepStream

        return StepStream(self, micro_batches=micro_batches, packs_per_micro_batch=packs_per_micro_batch)

    def pack_lengths(self, i: int) -> np.ndarray:
        """(k,) int64 real lengths of the sequences in pack ``i`` (from the plan: no token read),
        e.g. to balance work across ranks before building packs."""
        plan, order, _ = self._epoch_view()
        n = len(order)
        if not -n <= i < n:
            raise IndexError(f"pack {i} out of range: this rank has {n} packs in epoch {self._epoch}")
        return plan.segments(int(order[i]))[2]

    def __iter__(self) -> Iterator[Pack]:
        while self._position < len(self):
            pack = self[self._position]
            self._position += 1
            yield pack
        self._epoch, self._position = self._epoch + 1, 0

    # -- checkpointing -------------------------------------------------------------------
    def fingerprint(self, *, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
        """The settings that define the epochs' packs and their order (checked on resume)."""
        return settings_fingerprint(self.config, exclude=("pad_id", *exclude), num_sequences=len(self.lengths))

    def state_dict(self) -> dict[str, Any]:
        """Epoch, position in this rank's share of it, and the settings that define the stream."""
        return {"epoch": self._epoch, "position": self._position, "config": self.fingerprint()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state``; raises ``ValueError`` when it was saved with other settings."""
        check_saved_settings("PackedDataset", state["config"], self.fingerprint())
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
