"""thdpack.packing.dataset: per-epoch re-planning and shuffling, DP shards, exact resume, errors."""

from __future__ import annotations

import dataclasses
import inspect
import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thdpack.packing.dataset import DATASET_SEED, PackedDataset, PackedDatasetConfig
from thdpack.packing.dealing import epoch_seeds, plan_epoch
from thdpack.packing.runtime import PackingRuntime
from thdpack.plan import PlanConfig
from thdpack.testing import assert_resumable

from support.pack_checks import check_packs, unique_samples

RNG = np.random.default_rng(0)
LENGTHS = RNG.integers(1, 40, 120).tolist()
SAMPLES = unique_samples(LENGTHS, RNG, labels=False, loss_mask=True)


def make(**kwargs):
    kwargs = {"lengths": LENGTHS, **kwargs}
    return PackedDataset(SAMPLES, kwargs.pop("pack_size", 64), **kwargs)


def keys(ds):
    """Each pack of the epoch as a tuple of its first token ids (identifies the pack)."""
    return [tuple(p["input_ids"][:4].tolist()) for p in (ds[i] for i in range(len(ds)))]


@pytest.mark.parametrize(
    ("pack_size", "cp_size", "overflow"), [(40, 1, "error"), (32, 2, "split"), (32, 4, "truncate")]
)
def test_every_epoch_holds_every_token_once(pack_size, cp_size, overflow):
    ds = make(cp_size=cp_size, overflow=overflow, pack_size=pack_size)
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        check_packs([ds[i] for i in range(len(ds))], SAMPLES, pack_size, cp_size, 0, overflow)
    assert ds.stats.num_packs == len(ds) and ds.stats.cp_size == cp_size


def test_epochs_reshuffle_and_repair_reproducibly():
    ds = make()
    first = keys(ds)
    ds.set_epoch(1)
    second = keys(ds)
    assert sorted(first) != sorted(second)  # bfd with a new seed pairs sequences differently
    again = make()
    again.set_epoch(1)
    assert keys(again) == second  # same seed, same epoch: same packs, same order
    assert keys(make(seed=1)) != first
    assert epoch_seeds(0, 1) == epoch_seeds(0, 1) != epoch_seeds(0, 2)


def test_sequential_without_shuffle_is_nemo_order():
    ds = make(algorithm="sequential", shuffle=False)
    flat = [i for i in range(len(ds)) for i in ds[i]["input_ids"][ds[i]["input_ids"] > 0].tolist()]
    assert flat == sorted(flat)  # dataset order, pack after pack


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_data_parallel_ranks_share_the_epoch(world_size):
    ranks = [make(dp_rank=r, dp_size=world_size) for r in range(world_size)]
    total = ranks[0].epoch_shard.num_packs
    assert len({len(ds) for ds in ranks}) == 1 and len(ranks[0]) == -(-total // world_size)
    seen = [k for ds in ranks for k in keys(ds)]
    repeated = ranks[0].epoch_shard.repeated_packs
    assert repeated == len(ranks[0]) * world_size - total
    assert len(seen) == total + repeated and len(set(seen)) == total  # all packs, repeats only to even out
    assert sorted(set(seen)) == sorted(keys(make(shuffle=False)))


def test_remainder_drop_reports_what_it_leaves_out(caplog):
    with caplog.at_level(logging.WARNING, logger="thdpack"):
        ranks = [make(dp_rank=r, dp_size=4, remainder="drop") for r in range(4)]
    shard = ranks[0].epoch_shard
    assert shard.dropped_packs == shard.num_packs % 4 > 0 and shard.repeated_packs == 0
    seen = [k for ds in ranks for k in keys(ds)]
    assert len(seen) == len(set(seen)) == shard.num_packs - shard.dropped_packs
    assert shard.dropped_tokens > 0 and f"({shard.dropped_tokens} tokens) dropped" in caplog.text
    few = make(dp_rank=999, dp_size=1000, remainder="drop")  # made: the step stream needs no remainder
    with pytest.raises(ValueError, match=r"epoch 0 has \d+ packs for dp_size=1000 ranks: with remainder='drop'"):
        len(few)  # map-style access is where the policy applies


@settings(max_examples=15)
@given(st.integers(0, 10), st.sampled_from([(1, 0), (2, 0), (2, 1)]))
def test_resume_anywhere_in_an_epoch(stop_after, world):
    world_size, rank = world
    assert_resumable(lambda: make(pack_size=128, dp_size=world_size, dp_rank=rank), stop_after)


def test_iteration_moves_on_to_the_next_epoch_and_resumes_there():
    ds = make(pack_size=128)
    epoch0 = list(ds)
    assert ds.epoch == 1 and ds.state_dict()["position"] == 0
    it = iter(ds)
    head = [next(it), next(it)]
    state = ds.state_dict()
    assert (state["epoch"], state["position"]) == (1, 2)
    resumed = make(pack_size=128)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # a training loop's set_epoch with the resumed epoch keeps the position
    reference = make(pack_size=128)
    reference.set_epoch(1)
    epoch1 = list(reference)
    assert [p["seq_lens"].tolist() for p in epoch0] != [p["seq_lens"].tolist() for p in epoch1]
    got = head + list(resumed)
    assert len(got) == len(epoch1) and all(
        torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(got, epoch1, strict=True)
    )


def test_state_from_other_settings_is_refused():
    state = make().state_dict()
    with pytest.raises(ValueError, match=r"other settings \(pack_size: saved 64, now 128, .*seed: saved 0, now 3"):
        make(pack_size=128, seed=3).load_state_dict(state)


def test_lengths_are_computed_and_checked():
    ds = PackedDataset(SAMPLES[:5], 64)
    assert ds.lengths.tolist() == LENGTHS[:5]
    with pytest.raises(ValueError, match="got 4 lengths for 5 samples; give one per sample"):
        PackedDataset(SAMPLES[:5], 64, lengths=LENGTHS[:4])
    wrong = PackedDataset(SAMPLES[:5], 64, lengths=[1] * 5, shuffle=False)
    with pytest.raises(ValueError, match=r"sample \d+ has \d+ tokens but the plan was made for length 1"):
        wrong[0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"algorithm": "nf"}, "unknown algorithm 'nf'; valid: bfd, ffd, sequential, window"),
        ({"overflow": "wrap"}, "unknown overflow policy 'wrap'; valid: error, drop, truncate, split"),
        ({"remainder": "pad"}, "unknown remainder policy 'pad'; valid: repeat, drop"),
        (
            {"dp_rank": 2, "dp_size": 2},
            r"dp_rank=2 is not a rank of dp_size=2 data-parallel ranks; it must be in \[0, 2\)",
        ),
        ({"cp_size": 3}, r"pack_size=64 is not a multiple of 2\*cp_size=6"),
        ({"seed": -1}, "seed must be >= 0, got -1"),
        ({"pack_size": 0}, "pack_size must be >= 1, got 0"),
        ({"dp_size": 0}, "dp_size must be >= 1, got 0"),
    ],
)
def test_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pack_size": 64.0}, "pack_size must be an integer, got 64.0"),
        ({"cp_size": 2.0}, "cp_size must be an integer, got 2.0"),
        ({"dp_rank": True}, "dp_rank must be an integer, got True"),
        ({"pad_id": "0"}, "pad_id must be an integer token id, got '0'"),
        ({"shuffle": 1}, "shuffle must be True or False, got 1"),
    ],
)
def test_values_of_the_wrong_type(kwargs, message):
    with pytest.raises(TypeError, match=message):
        make(**kwargs)


def test_the_config_takes_the_runs_typed_runtime_beside_it():
    config = PackedDatasetConfig(plan=PlanConfig(pack_size=64, seed=0))
    runtime = PackingRuntime(cp_size=2, dp_rank=1, dp_size=2, pad_id=7)
    built = config.build(SAMPLES, runtime, lengths=LENGTHS)
    flat = make(cp_size=2, dp_rank=1, dp_size=2, pad_id=7)
    assert built.config == flat.config and keys(built) == keys(flat) and built.state_dict() == flat.state_dict()
    assert built.runtime == flat.runtime == runtime
    with pytest.raises(TypeError, match=r"runtime must be a thdpack\.packing\.PackingRuntime, got dict"):
        config.build(SAMPLES, {"cp_size": 2})
    with pytest.raises(TypeError, match="unexpected keyword argument 'pack_size'"):
        config.build(SAMPLES, pack_size=32)


def test_the_keywords_are_every_field_of_the_config_and_the_runtime():
    """The flat door takes every setting (the plan's listed flat) and runtime value, generated from
    the fields: the adaptive placement too, which the hand-written door could not reach."""
    fields = {f.name for f in dataclasses.fields(PlanConfig)} | {f.name for f in dataclasses.fields(PackingRuntime)}
    fields |= {f.name for f in dataclasses.fields(PackedDatasetConfig)} - {"plan"}
    assert set(inspect.signature(PackedDataset).parameters) == {"samples", "lengths", "first_plan"} | fields
    adaptive = PackedDataset(SAMPLES, 64, lengths=LENGTHS, cp_size=4, cp_placement="adaptive", cost_model="pairs")
    assert adaptive.config.plan.cp_placement == "adaptive" and adaptive.plan.placement is not None
    assert adaptive.config == PackedDatasetConfig(
        plan=PlanConfig(pack_size=64, seed=DATASET_SEED, cp_placement="adaptive", cost_model="pairs")
    )
    for f in dataclasses.fields(PlanConfig)[1:]:  # its help, in the door's docstring (pack_size is positional)
        assert f.name in PackedDataset.__init__.__doc__ and f.metadata["help"][:40] in " ".join(
            PackedDataset.__init__.__doc__.split()
        )
    with pytest.raises(TypeError, match=r"PackedDataset\(\) got an unexpected keyword argument 'rank'; it takes"):
        make(rank=1)


def test_a_given_first_plan_is_used_for_epoch_0_and_must_be_that_plan():
    config = PackedDatasetConfig(plan=PlanConfig(pack_size=64, seed=3))
    lengths = np.array(LENGTHS)
    plan = plan_epoch(lengths, config.plan, cp_size=2, epoch=0)
    cp2 = PackingRuntime(cp_size=2)
    given = config.build(SAMPLES, cp2, lengths=LENGTHS, first_plan=plan)
    assert given.plan is plan and given.plans_made == 0 and keys(given) == keys(config.build(SAMPLES, cp2))
    given.set_epoch(1)
    assert given.plan is not plan and given.plans_made == 1  # later epochs are the run's own
    other = plan_epoch(lengths, PlanConfig(pack_size=64, seed=4), cp_size=2, epoch=0)
    with pytest.raises(ValueError, match=r"the given plan is not what epoch 0 plans \(seed: plan \d+, epoch 0 \d+\)"):
        config.build(SAMPLES, cp2, lengths=LENGTHS, first_plan=other)
    with pytest.raises(ValueError, match=r"cp_size: plan 2, epoch 0 1"):
        config.build(SAMPLES, lengths=LENGTHS, first_plan=plan)


def test_bad_access():
    ds = make()
    with pytest.raises(IndexError, match=rf"pack {len(ds)} out of range: this rank has {len(ds)} packs in epoch 0"):
        ds[len(ds)]
    with pytest.raises(ValueError, match="epoch must be >= 0, got -1"):
        ds.set_epoch(-1)
    with pytest.raises(ValueError, match="sequence 0 has 7 tokens, over pack_size=4"):
        PackedDataset([{"input_ids": list(range(7))}], 4)
