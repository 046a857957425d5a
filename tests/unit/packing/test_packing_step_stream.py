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


def test_the_state_is_the_same_on_every_rank_and_refuses_other_data():
    rank0 = dataset(dp_size=2, dp_rank=0).step_stream(micro_batches=2, packs_per_micro_batch=1)
    rank1 = dataset(dp_size=2, dp_rank=1).step_stream(micro_batches=2, packs_per_micro_batch=1)
    take(rank0, 2)
    assert rank1.load_state_dict(rank0.state_dict()).message is None  # rank 0 saves, every rank loads
    other = PackedDataset(SAMPLES[:-1], 64, lengths=LENGTHS[:-1], seed=5).step_stream(
        micro_batches=2, packs_per_micro_batch=1
    )
    with pytest.raises(ValueError, match=r"the saved data position is over 90 sequences, and this data has 89: it"):
        other.load_state_dict(rank0.state_dict())
    with pytest.raises(ValueError, match="micro_batches must be >= 1, got 0"):
        dataset().step_stream(micro_batches=0, packs_per_micro_batch=1)


def test_remainder_is_not_a_setting_of_the_step_stream(caplog):
    """remainder shapes map-style access only: the stream neither saves it nor logs repeats, and
    runs with fewer packs in an epoch than ranks, where remainder='drop' would refuse."""
    repeat = dataset(dp_size=2, dp_rank=0).step_stream(micro_batches=1, packs_per_micro_batch=1)
    drop = dataset(dp_size=2, dp_rank=0, remainder="drop").step_stream(micro_batches=1, packs_per_micro_batch=1)
    assert "remainder" not in repeat.state_dict()["settings"]
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


# -- resume on another layout or with other settings ----------------------------------------

LONG = np.random.default_rng(2).integers(1, 150, 120).tolist()
"""Lengths up to 150: some longer than the 64-token packs, split into pieces (overflow='split')."""
LONG_SAMPLES = unique_samples(LONG, np.random.default_rng(3), labels=False, loss_mask=False)


class Run:
    """Streams of every data-parallel rank of one layout, recording the packs each builds (with
    their epoch); the dataset's keywords ``settings``."""

    def __init__(self, *, dp: int = 1, micro_batches: int = 1, **settings) -> None:
        settings = {"overflow": "split", "seed": 5, **settings}
        pack_size = settings.pop("pack_size", 64)
        self.datasets = [
            PackedDataset(LONG_SAMPLES, pack_size, lengths=LONG, dp_size=dp, dp_rank=r, **settings) for r in range(dp)
        ]
        self.built: list[tuple[int, dict]] = []
        self.streams = [self._stream(data, micro_batches) for data in self.datasets]

    def _stream(self, data: PackedDataset, micro_batches: int) -> StepStream:
        def build(epoch, index):
            pack = data.epoch_pack(epoch, index)
            self.built.append((epoch.number, pack))
            return pack

        runtime = data.runtime
        return StepStream(data.epochs, build, rank=runtime.dp_rank, world_size=runtime.dp_size,
                          balance=data.config.balance, micro_batches=micro_batches, packs_per_micro_batch=1)  # fmt: skip

    def resume(self, state, **names) -> list[str | None]:
        return [stream.load_state_dict(state, names=names).message for stream in self.streams]

    def steps(self, count: int) -> list[str]:
        """The digests of the next ``count`` steps (the same on every rank)."""
        digests = []
        for _ in range(count):
            steps = [stream.next_step() for stream in self.streams]
            assert len({step.packs_sha256 for step in steps}) == 1
            digests.append(steps[0].packs_sha256)
        return digests

    def until_epoch(self, epoch: int) -> None:
        while self.streams[0].epoch < epoch:
            self.steps(1)

    def tokens(self, epoch: int) -> list[int]:
        """The real token ids of the packs built in ``epoch`` (unique ids: each names a sample and offset)."""
        ids = [pack["input_ids"][pack["input_ids"] > 0] for number, pack in self.built if number == epoch]
        return sorted(torch.cat(ids).tolist())


ALL_TOKENS = list(range(1, sum(LONG) + 1))


def test_a_layout_with_the_same_packs_per_step_continues_with_the_same_steps():
    """dp 2 x 1 micro-batch -> dp 1 x 2 micro-batches (and back): the packs per step stay 2, so the
    steps hold the same packs (digests) and the message says so."""
    straight = Run(dp=2).steps(12)
    first = Run(dp=2)
    head = first.steps(5)
    narrow = Run(dp=1, micro_batches=2)
    said = narrow.resume(first.streams[0].state_dict(), micro_batches="train.micro_batches")
    assert said == [
        "data-parallel size 2 -> 1, train.micro_batches 1 -> 2: packs per step stay 2, so the run continues with the "
        "same packs in the same steps (losses equal an unchanged run's up to floating-point reduction order)"
    ]
    middle = narrow.steps(4)
    wide = Run(dp=2)
    wide.resume(narrow.streams[0].state_dict())
    assert head + middle + wide.steps(3) == straight


def test_every_sequence_of_an_epoch_is_consumed_once_over_three_plan_changes():
    """cp 2 -> cp 1 with 2 packs per step -> dp 2 with 96-token packs -> cp 4 adaptive: each change
    plans the epoch's rest again; the packs built over epoch 0 hold every token once (unique ids)."""
    runs = [
        (dict(cp_size=2), 5),
        (dict(cp_size=1, micro_batches=2), 4),
        (dict(dp=2, pack_size=96, algorithm="sequential"), 3),
        (dict(cp_size=4, cp_placement="adaptive", pack_size=64), None),
    ]
    tokens: list[int] = []
    state, messages = None, []
    for settings, steps in runs:
        run = Run(**settings)
        if state is not None:
            messages += run.resume(state, cp_size="parallel.cp_size", pack_size="packing.pack_size")[:1]
        if steps is None:
            run.until_epoch(1)
        else:
            run.steps(steps)
        state = run.streams[0].state_dict()
        tokens += run.tokens(0)
    assert sorted(tokens) == ALL_TOKENS  # each token of epoch 0 exactly once
    assert state["epoch"] == 1 and state["replans"] == 0  # epoch 1 is planned as usual
    assert messages[0].startswith(
        "packs per step 1 -> 2, parallel.cp_size 2 -> 1, micro_batches 1 -> 2: the remaining "
    )
    assert messages[0].endswith(" sequences of epoch 0 are planned again with parallel.cp_size=1; losses will differ "
                                "from an unchanged run")  # fmt: skip
    assert "packing.pack_size 64 -> 96, algorithm bfd -> sequential" in messages[1]
    assert "cp_placement te -> adaptive" in messages[2]


def test_a_resume_after_a_replan_with_the_same_settings_continues_exactly():
    first = Run(cp_size=2)
    first.steps(4)
    replanned = Run(cp_size=1)
    replanned.resume(first.streams[0].state_dict())
    replanned.steps(3)
    state = replanned.streams[0].state_dict()
    assert state["replans"] == 1 and state["consumed_before"] is not None
    uninterrupted = replanned.steps(6)
    again = Run(cp_size=1)
    assert again.resume(state) == [None]
    assert again.steps(6) == uninterrupted
    before = replanned.streams[0]._rest.consumed_before
    assert state["consumed"]["tokens"] > before.tokens  # the record counts what the re-planned packs consumed


def test_packs_per_step_change_keeps_the_plan_and_consumes_each_pack_once():
    first = Run(dp=1, micro_batches=3)
    first.steps(4)
    other = Run(dp=1, micro_batches=2)
    (said,) = other.resume(first.streams[0].state_dict())
    assert said.startswith("packs per step 3 -> 2, micro_batches 3 -> 2: epoch 0's remaining ") and said.endswith(
        " packs are the same, 2 per step; losses will differ from an unchanged run"
    )
    other.until_epoch(1)
    assert sorted(first.tokens(0) + other.tokens(0)) == ALL_TOKENS


def test_truncated_rests_stay_consumed_after_a_replan():
    """overflow='truncate': a sequence whose first 64 tokens were trained is consumed (its cut-off
    rest is not trained this epoch), even when the rest is planned with 128-token packs."""
    first = Run(overflow="truncate")
    first.steps(10)
    state = first.streams[0].state_dict()
    trained = first.tokens(0)
    second = Run(overflow="truncate", pack_size=128)
    second.resume(state)
    second.until_epoch(1)
    later = second.tokens(0)
    assert not set(trained) & set(later)
    cut_after_first = {s for s, n in enumerate(LONG) if n > 64 and (sum(LONG[:s]) + 1) in trained}
    starts = np.cumsum([0, *LONG])
    assert cut_after_first and not any(starts[s] < t <= starts[s + 1] for s in cut_after_first for t in later)
    assert state["consumed"]["tokens"] > len(trained)  # the cut-off rests count as consumed


def test_a_state_without_the_consumed_pieces_resumes_only_with_its_settings():
    """A checkpoint of an older thdpack holds the epoch, the position and the settings only."""
    first = Run(cp_size=2)
    first.steps(3)
    full = first.streams[0].state_dict()
    old = {"epoch": full["epoch"], "position": full["position"], **full["settings"]}
    same = Run(cp_size=2)
    assert same.resume(old) == [None]
    with pytest.raises(ValueError, match=r"saved without the sequences it consumed \(an older thdpack\), so its epoch "
                       r"cannot be planned again with other settings \(parallel.cp_size 2 -> 1\); resume with"):  # fmt: skip
        Run(cp_size=1).resume(old, cp_size="parallel.cp_size")


def test_a_damaged_record_is_refused():
    first = Run(cp_size=2)
    first.steps(3)
    state = first.streams[0].state_dict()
    state["arrays"]["consumed.sample"] = state["arrays"]["consumed.sample"] + 1
    with pytest.raises(ValueError, match="the stream state's consumed pieces do not match their sha256"):
        Run(cp_size=1).resume(state)


def test_a_change_at_an_epoch_start_plans_that_epoch_as_a_fresh_run_would():
    first = Run(cp_size=2)
    first.until_epoch(1)  # one pack a step: the stream stands at the start of epoch 1
    state = first.streams[0].state_dict()
    assert (state["epoch"], state["position"], state["consumed"]["tokens"]) == (1, 0, 0)
    other = Run(cp_size=1)
    (said,) = other.resume(state, cp_size="parallel.cp_size")
    assert said == "parallel.cp_size 2 -> 1: epoch 1 (not begun) and the later ones are planned with parallel.cp_size=1"
    assert other.streams[0].current() is other.datasets[0].epochs[1]
