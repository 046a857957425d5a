"""thdpack.packing.step_stream: optimizer steps cut from the dealer's epochs and dealt to DP ranks."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from thdpack.cp import shard, unshard
from thdpack.packing import PackedDataset, PackedDatasetConfig, PackingRuntime
from thdpack.packing.step_stream import StepStream
from thdpack.plan import PlanConfig
from thdpack.thd import thd_collate

from support.pack_checks import unique_samples

RNG = np.random.default_rng(1)
LENGTHS = RNG.integers(1, 40, 90).tolist()
SAMPLES = unique_samples(LENGTHS, RNG, labels=False, loss_mask=False)


def dataset(**kwargs) -> PackedDataset:
    return PackedDataset(SAMPLES, 64, lengths=LENGTHS, seed=5, **kwargs)


def ids(pack) -> tuple[int, ...]:
    return tuple(pack["input_ids"][pack["input_ids"] > 0].tolist())


def take(stream: StepStream, steps: int) -> list[list[tuple[int, ...]]]:
    return [[ids(p) for mb in stream.next_step().micro_batches for p in mb] for _ in range(steps)]


def test_each_epoch_is_planned_once_while_steps_straddle_its_boundary():
    data = dataset(dp_size=2, dp_rank=0)
    stream = data.step_stream(micro_batches=3, packs_per_micro_batch=1)  # 6 packs a step
    packs_per_epoch = len(data.epochs[0])
    assert packs_per_epoch % 6  # some step takes the end of one epoch and the start of the next
    steps = 3 * packs_per_epoch // 6 + 1
    take(stream, steps)
    assert stream.epoch >= 2 and data.plans_made == stream.epoch + 1  # epochs 0..epoch, once each


def test_ranks_get_disjoint_complete_and_balanced_shares():
    world = 3
    streams = [
        dataset(dp_size=world, dp_rank=r).step_stream(micro_batches=2, packs_per_micro_batch=2) for r in range(3)
    ]
    everything = dataset(balance="none").step_stream(micro_batches=2 * world, packs_per_micro_batch=2)
    for _ in range(4):
        steps = [s.next_step() for s in streams]
        shares = [[ids(p) for mb in step.micro_batches for p in mb] for step in steps]
        whole = [ids(p) for mb in everything.next_step().micro_batches for p in mb]
        assert sorted(p for share in shares for p in share) == sorted(whole)  # each pack once, on one rank
        assert all(len(share) == 4 for share in shares)
        assert steps[0].imbalance == steps[1].imbalance and steps[0].imbalance.attention < 1.3


def test_resume_mid_epoch_and_across_a_boundary_equals_the_uninterrupted_stream():
    uninterrupted = take(dataset(dp_size=2, dp_rank=1).step_stream(micro_batches=2, packs_per_micro_batch=1), 30)
    for stop in (1, 7, 13):
        first = dataset(dp_size=2, dp_rank=1).step_stream(micro_batches=2, packs_per_micro_batch=1)
        head = take(first, stop)
        resumed = dataset(dp_size=2, dp_rank=1).step_stream(micro_batches=2, packs_per_micro_batch=1)
        resumed.load_state_dict(first.state_dict())
        assert head + take(resumed, 30 - stop) == uninterrupted


def test_the_state_is_the_same_on_every_rank_and_checks_the_settings():
    rank0 = dataset(dp_size=2, dp_rank=0).step_stream(micro_batches=2, packs_per_micro_batch=1)
    rank1 = dataset(dp_size=2, dp_rank=1).step_stream(micro_batches=2, packs_per_micro_batch=1)
    rank1.load_state_dict(rank0.state_dict())  # rank 0 saves, every rank loads
    other = PackedDataset(SAMPLES, 64, lengths=LENGTHS, seed=6, dp_size=2).step_stream(
        micro_batches=2, packs_per_micro_batch=1
    )
    with pytest.raises(
        ValueError, match=r"state was saved by a StepStream with other settings \(seed: saved 5, now 6\)"
    ):
        other.load_state_dict(rank0.state_dict())
    with pytest.raises(ValueError, match="micro_batches must be >= 1, got 0"):
        dataset().step_stream(micro_batches=0, packs_per_micro_batch=1)


def test_remainder_is_not_a_setting_of_the_step_stream(caplog):
    """remainder shapes map-style access only: the stream neither saves it nor logs repeats, and
    runs with fewer packs in an epoch than ranks, where remainder='drop' would refuse."""
    repeat = dataset(dp_size=2, dp_rank=0).step_stream(micro_batches=1, packs_per_micro_batch=1)
    drop = dataset(dp_size=2, dp_rank=0, remainder="drop").step_stream(micro_batches=1, packs_per_micro_batch=1)
    assert "remainder" not in repeat.state_dict()
    drop.load_state_dict(repeat.state_dict())
    with caplog.at_level(logging.INFO, logger="thdpack"):
        assert take(drop, 5) == take(repeat, 5)
    assert "repeated" not in caplog.text and "dropped" not in caplog.text
    few = PackedDataset(SAMPLES[:3], 64, dp_size=8, dp_rank=7, remainder="drop")  # fewer packs than ranks
    assert len(take(few.step_stream(micro_batches=1, packs_per_micro_batch=1), 2)[0]) == 1
    with pytest.raises(ValueError, match="with remainder='drop' some ranks would get none"):
        few[0]


def test_the_trainer_packing_group_is_the_dataset_config():
    import dataclasses
    from pathlib import Path

    import yaml

    from thdpack.packing.dataset import PackedDatasetConfig
    from thdpack.plan import PlanConfig
    from thdpack.train.config import Config, PackingNode

    settings = {f.name for f in dataclasses.fields(PackedDatasetConfig)} - {"plan"}
    settings |= {f.name for f in dataclasses.fields(PlanConfig)}  # listed flat: packing.pack_size
    assert {f.name for f in dataclasses.fields(PackingNode)} == settings  # and no runtime value
    cfg = Config()
    assert isinstance(cfg.packing_config, PackedDatasetConfig) and cfg.packing_config is cfg.packing_config
    assert cfg.packing_config.plan == PlanConfig(pack_size=1024, seed=0, cp_placement="adaptive")  # the trainer default
    for preset in (Path(__file__).resolve().parents[3] / "configs" / "packing").glob("*.yaml"):
        assert yaml.safe_load(preset.read_text())["overflow"] == "split", preset.name  # training: no token lost


def _adaptive(**runtime) -> PackedDataset:
    plan = PlanConfig(pack_size=64, seed=5, cp_placement="adaptive")
    return PackedDatasetConfig(plan=plan).build(SAMPLES, PackingRuntime(cp_size=4, **runtime), lengths=LENGTHS)


def test_an_adaptive_plan_streams_placed_packs_that_shard_and_resume():
    """packing.cp_placement=adaptive: the steps' packs carry their placement, collate and shard by
    it on every CP rank, and a resumed stream repeats the uninterrupted one."""
    stream = _adaptive(dp_size=2, dp_rank=1).step_stream(micro_batches=2, packs_per_micro_batch=2)
    step = stream.next_step()
    for micro in step.micro_batches:
        thd = thd_collate(list(micro))
        assert thd["thd_meta"].groups is not None and thd["thd_meta"].groups.cp_size == 4
        assert (thd["thd_meta"].groups.size_S == 1).any()  # short sequences whole on one rank
        shards = [shard(thd, 4, r) for r in range(4)]
        assert torch.equal(unshard(shards, 4)["input_ids"], thd["input_ids"])
    uninterrupted = take(_adaptive(dp_size=2, dp_rank=1).step_stream(micro_batches=2, packs_per_micro_batch=1), 12)
    first = _adaptive(dp_size=2, dp_rank=1).step_stream(micro_batches=2, packs_per_micro_batch=1)
    head = take(first, 5)
    resumed = _adaptive(dp_size=2, dp_rank=1).step_stream(micro_batches=2, packs_per_micro_batch=1)
    resumed.load_state_dict(first.state_dict())
    assert head + take(resumed, 7) == uninterrupted
