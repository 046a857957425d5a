"""PackedDataset: a map-style dataset of packs, planned over sequence lengths, built on the fly.

The dataset holds a plan (index arrays, a few bytes per sequence) and builds pack ``i`` when asked,
so host memory stays proportional to one pack. Every epoch is planned again and its packs shuffled
with a seed derived from ``(seed, epoch)``: the same seed and epoch give the same packs in the same
order on every machine. With ``dp_size > 1`` each rank gets a disjoint, interleaved share of the
epoch's packs (``remainder`` evens the ranks out); ``step_stream``, what the trainer uses, deals
whole optimizer steps instead. ``PackedDataset(samples, pack_size, **keywords)`` takes every setting
of ``PackedDatasetConfig`` and of the run's ``PackingRuntime`` by name; ``config.build(samples,
runtime)`` is a call of it.

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

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from thdpack._config_forms import FlatKeywords, Part, flat_values
from thdpack._settings import Settings, check_int, flag, one_of, setting
from thdpack.packing.dealing import BALANCES, REMAINDERS, Balance, Epoch, Epochs, EpochShard, Remainder, rank_share
from thdpack.packing.packer import Pack, build_pack, read_sample
from thdpack.packing.runtime import PackingRuntime
from thdpack.packing.saved_settings import check_saved_settings
from thdpack.packing.step_stream import StepStream
from thdpack.plan.api import as_lengths
from thdpack.plan.config import PlanConfig
from thdpack.plan.packing_stats import PackingStats
from thdpack.plan.packplan import PackPlan

DATASET_SEED = 0
"""The base seed where a dataset is made from keywords or options (``PackedDataset``'s keywords,
the trainer's ``packing.seed``, ``thdpack prepare --seed``) instead of ``PlanConfig``'s None: a
dataset re-plans every epoch with a seed derived from (seed, epoch), so that bfd / ffd packs differ
from epoch to epoch."""


def _plan_config(name: str, value: Any) -> PlanConfig:
    if not isinstance(value, PlanConfig):
        raise TypeError(f"{name} must be a thdpack.plan.PlanConfig, got {type(value).__name__}")
    return value


@dataclass(frozen=True, kw_only=True)
class PackedDatasetConfig(Settings):
    """Settings of a ``PackedDataset`` (the trainer's ``packing`` group)."""

    plan: PlanConfig = setting(
        "How every epoch is planned; plan.seed is the base seed: epoch e plans and shuffles with seeds "
        "derived from (seed, e).",
        check=_plan_config,
    )
    shuffle: bool = setting(
        "Shuffle the pack order of every epoch (bfd / ffd plans come largest first otherwise).",
        default=True,
        check=flag,
    )
    remainder: Remainder = setting(
        "Map-style access (ds[i], iter(ds)) when dp_size does not divide an epoch's packs: 'repeat' packs "
        "or 'drop' them. step_stream never needs it.",
        default="repeat",
        check=one_of(REMAINDERS, "remainder policy"),
    )
    balance: Balance = setting(
        "How step_stream deals each step's packs to the data-parallel ranks: balancing attention cost and "
        "tokens ('attention'), tokens only ('tokens'), or in order ('none').",
        default="attention",
        check=one_of(BALANCES),
    )

    def build(
        self,
        samples: Sequence[Mapping[str, Any]],
        runtime: PackingRuntime = PackingRuntime(),
        *,
        lengths: Sequence[int] | np.ndarray | None = None,
        first_plan: PackPlan | None = None,
    ) -> PackedDataset:
        """The dataset of ``samples`` with these settings and the run's ``runtime``: ``PackedDataset``
        with both as keywords. ``lengths`` (one per sample) saves a pass over the samples;
        ``first_plan`` is epoch 0's plan made beforehand (by ``thdpack prepare``)."""
        if not isinstance(runtime, PackingRuntime):
            raise TypeError(f"runtime must be a thdpack.packing.PackingRuntime, got {type(runtime).__name__}")
        keywords = {**flat_values(self, ("plan",)), **flat_values(runtime)}
        return PackedDataset(samples, lengths=lengths, first_plan=first_plan, **keywords)


DATASET_KEYWORDS = FlatKeywords(
    "PackedDataset",
    [Part(PackedDatasetConfig, flatten=("plan",)), Part(PackingRuntime)],
    defaults={"seed": DATASET_SEED},
)
"""``PackedDataset``'s keywords: every field of its config (the plan's listed flat) and runtime."""


class PackedDataset(torch.utils.data.Dataset):
    """Packs of ``samples`` (mappings with ``input_ids``, optional ``labels`` / ``loss_mask``).

    ``ds[i]`` builds pack ``i`` of this rank's share of the current epoch (a ``Pack``: int64
    tensors ``input_ids``, ``labels``, ``position_ids`` of length pack_size, ``seq_lens``,
    ``seq_lens_padded``). ``iter(ds)`` yields the rest of the epoch from the saved position
    and then moves on to the next epoch; ``state_dict()`` captures epoch, seed and position.
    The number of packs can differ between epochs with bfd/ffd re-planning. Epoch 0 is
    planned when the dataset is made, so a bad setting or an over-long sequence fails at once.

    Batch packs with ``thdpack.collate`` (or ``thdpack.compat.nemo.packed_sequence_thd_collater``):
    ``seq_lens`` differ in length from pack to pack, so torch's default collate cannot stack them.
    With a ``DataLoader`` the sampler decides the order of ``ds[i]``; ``state_dict()`` then still
    carries epoch and seed, and the loader (e.g. torchdata's ``StatefulDataLoader``) its position.
    """

    @DATASET_KEYWORDS.document
    def __init__(
        self,
        samples: Sequence[Mapping[str, Any]],
        pack_size: int,
        *,
        lengths: Sequence[int] | np.ndarray | None = None,
        first_plan: PackPlan | None = None,
        **keywords: Any,
    ) -> None:
        """The packs of ``samples`` in ``pack_size`` tokens; epoch 0 is planned here.

        Args:
            samples: indexable mappings with ``input_ids`` and optional ``labels`` / ``loss_mask``.
            pack_size: tokens per pack.
            lengths: one per sample, saving a pass over the samples (checked as packs are built).
            first_plan: epoch 0's plan made beforehand (``thdpack prepare``'s); it must be the plan
                epoch 0 makes.
            **keywords: every other setting and runtime value by name (listed below; defaults as
                their configs', but ``seed``: ``DATASET_SEED``).
        """
        config, runtime = DATASET_KEYWORDS.build(pack_size=pack_size, **keywords)
        self.config: PackedDatasetConfig = config
        self.runtime: PackingRuntime = runtime
        self.samples = samples
        if lengths is None:
            lengths = [len(read_sample(samples[i], i)) for i in range(len(samples))]
        self.lengths = as_lengths(lengths)
        if len(self.lengths) != len(samples):
            raise ValueError(f"got {len(self.lengths)} lengths for {len(samples)} samples; give one per sample")
        self.epochs = Epochs(
            self.lengths, config.plan, cp_size=runtime.cp_size, shuffle=config.shuffle, first_plan=first_plan,
            timing=runtime.timing,
        )  # fmt: skip
        """Every epoch's plan and pack order (``thdpack.packing.dealing``)."""
        self.epochs[0]  # planned now: a bad setting or an over-long sequence fails here, not at the first pack
        self._epoch = 0
        self._position = 0
        self._share: tuple[int, np.ndarray, EpochShard] | None = None

    @property
    def plans_made(self) -> int:
        """How many epoch plans this dataset computed (each epoch once)."""
        return self.epochs.plans_made

    # -- the current epoch ---------------------------------------------------------------
    def _mine(self) -> tuple[Epoch, np.ndarray, EpochShard]:
        """The current epoch and this rank's map-style share of it (positions in its order)."""
        epoch = self.epochs[self._epoch]
        if self._share is None or self._share[0] != self._epoch:
            mine, shard = rank_share(
                epoch, rank=self.runtime.dp_rank, world_size=self.runtime.dp_size, remainder=self.config.remainder
            )
            self._share = (self._epoch, mine, shard)
        return epoch, self._share[1], self._share[2]

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def plan(self) -> PackPlan:
        """The current epoch's plan (all ranks' packs)."""
        return self.epochs[self._epoch].plan

    @property
    def stats(self) -> PackingStats:
        """The current epoch's ``PackingStats`` (what overflow dropped / truncated / split included)."""
        return self.plan.stats

    @property
    def epoch_shard(self) -> EpochShard:
        """How the current epoch was dealt to the ranks for map-style access (repeated / dropped packs)."""
        return self._mine()[2]

    def set_epoch(self, epoch: int) -> None:
        """Switch to ``epoch`` (re-plans lazily); the position restarts unless it is the current epoch,
        so calling ``set_epoch`` with the resumed epoch keeps a restored position."""
        epoch = check_int("epoch", epoch, 0)
        if epoch != self._epoch:
            self._epoch, self._position = epoch, 0

    # -- map-style access ----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._mine()[1])

    def _position_of(self, i: int) -> tuple[Epoch, int]:
        epoch, mine, _ = self._mine()
        n = len(mine)
        if not -n <= i < n:
            raise IndexError(f"pack {i} out of range: this rank has {n} packs in epoch {self._epoch}")
        return epoch, int(mine[i])

    def __getitem__(self, i: int) -> Pack:
        epoch, position = self._position_of(i)
        return self.epoch_pack(epoch, position)

    def epoch_pack(self, epoch: Epoch, index: int) -> Pack:
        """Pack ``index`` of ``epoch``'s whole order (all ranks' packs; ``step_stream`` deals them)."""
        return build_pack(self.samples, epoch.plan, int(epoch.order[index]), pad_id=self.runtime.pad_id)

    def step_stream(self, *, micro_batches: int, packs_per_micro_batch: int) -> StepStream:
        """Optimizer steps over every epoch's packs, dealt to this dataset's data-parallel rank
        (``runtime.dp_rank`` of ``dp_size``) by ``balance``: :class:`thdpack.packing.step_stream.StepStream`."""
        return StepStream(
            self.epochs,
            self.epoch_pack,
            rank=self.runtime.dp_rank,
            world_size=self.runtime.dp_size,
            balance=self.config.balance,
            micro_batches=micro_batches,
            packs_per_micro_batch=packs_per_micro_batch,
        )

    def pack_lengths(self, i: int) -> np.ndarray:
        """(k,) int64 real lengths of the sequences in pack ``i`` (from the plan: no token read),
        e.g. to balance work across ranks before building packs."""
        epoch, position = self._position_of(i)
        return epoch.segments(position)[2]

    def __iter__(self) -> Iterator[Pack]:
        while self._position < len(self):
            pack = self[self._position]
            self._position += 1
            yield pack
        self._epoch, self._position = self._epoch + 1, 0

    # -- checkpointing -------------------------------------------------------------------
    def fingerprint(self) -> dict[str, Any]:
        """The settings that define this rank's map-style packs and their order (checked on resume)."""
        return {
            **self.epochs.fingerprint(),
            "remainder": self.config.remainder,
            "rank": self.runtime.dp_rank,
            "world_size": self.runtime.dp_size,
        }

    def state_dict(self) -> dict[str, Any]:
        """Epoch, position in this rank's share of it, and the settings that define the stream."""
        return {"epoch": self._epoch, "position": self._position, "config": self.fingerprint()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state``; raises ``ValueError`` when it was saved with other settings."""
        check_saved_settings("PackedDataset", state["config"], self.fingerprint())
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
