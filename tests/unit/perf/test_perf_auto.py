"""``cp_placement="auto"``: by the step model, no pack is slower than the same pack by its adaptive
placement, by TE's layout or by all-to-all, and no epoch slower than the adaptive one."""

from __future__ import annotations

import numpy as np
import pytest

from thdpack.layout.placement import CpPlacement
from thdpack.layout.rules import round_up_to_cp
from thdpack.perf.auto import all_split, pack_seconds
from thdpack.perf.time_cost import TimeCostModel
from thdpack.plan import PackPlan, plan_packs
from thdpack.plan.adaptive import plan_entries
from thdpack.plan.overflow import apply_overflow

from support.placement_cases import mixed_auto_plan

TIMING = TimeCostModel.load("h100_sxm", "llama3-8b")
MODEL = {"profile": "h100_sxm", "model_shape": "llama3-8b", "timing": TIMING}
"""The settings and the timing (the same machine and model) of an auto plan."""


def _mixes(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.lognormal(np.log(300), 1.0, 3000).astype(np.int64).clip(1, 16384),  # SFT-like
        np.concatenate((rng.integers(4000, 16000, 60), rng.integers(1, 800, 2000))),  # a long tail
        rng.lognormal(np.log(1024) - 1.125, 1.5, 3000).astype(np.int64).clip(128, 16384),  # Megatron's mix
    ]


def _each_pack(placement: CpPlacement, a2a_P: np.ndarray, model) -> np.ndarray:
    """(P,) modelled seconds of each pack as the plan runs it."""
    return np.where(a2a_P, pack_seconds(placement, model, "a2a"), pack_seconds(placement, model))


@pytest.mark.parametrize("cp", [2, 4, 8, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_no_pack_is_slower_than_by_its_placement_te_or_a2a(cp, seed):
    model = TIMING.model
    packs = 0
    for lengths in _mixes(seed):
        plan = plan_packs(lengths, 16384, cp_size=cp, cp_placement="auto", overflow="split", **MODEL)
        assert plan.cp_placement == "auto" and plan.cost_model in ("time", "tiles")
        placement, a2a_P = plan.placement, plan.a2a_packs
        placement.validate(sequence_ids=plan.indices)
        mine = _each_pack(placement, a2a_P, model)
        # the same packs planned adaptive by the packing auto kept: the placement before each pack's choice
        entries = apply_overflow(lengths, 16384, "split").length
        costing = TIMING if plan.cost_model == "time" else "tiles"
        adaptive = plan_entries(entries, 16384, cp, algorithm="bfd", window=1024, rng=None, cost_model=costing)[2]
        assert np.array_equal(adaptive.offsets, placement.offsets)
        assert np.array_equal(adaptive.lengths, placement.lengths)
        assert (mine <= pack_seconds(adaptive, model) * (1 + 1e-12)).all()
        te_fits = np.add.reduceat(round_up_to_cp(placement.lengths, cp), placement.offsets[:-1]) <= 16384
        assert (mine[te_fits] <= pack_seconds(all_split(placement), model)[te_fits] * (1 + 1e-12)).all()
        assert (mine <= pack_seconds(placement, model, "a2a") * (1 + 1e-12)).all()
        packs += len(plan)
    assert packs > 100


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_an_auto_epoch_is_never_slower_than_the_adaptive_one(cp):
    model = TIMING.model
    for lengths in _mixes(2):
        auto = plan_packs(lengths, 16384, cp_size=cp, cp_placement="auto", overflow="split", **MODEL)
        adaptive = plan_packs(lengths, 16384, cp_size=cp, cp_placement="adaptive", overflow="split")
        assert _each_pack(auto.placement, auto.a2a_packs, model).sum() <= pack_seconds(adaptive.placement, model).sum()


def test_an_auto_plan_saves_and_loads_its_all_to_all_packs(tmp_path):
    lengths = _mixes(3)[2]
    plan = plan_packs(lengths, 16384, cp_size=8, cp_placement="auto", overflow="split", **MODEL)
    assert plan.a2a_packs.any() and not plan.a2a_packs.all()  # this mix takes both
    assert "packs attended by all-to-all" in plan.placement_summary()
    plan.save(tmp_path / "plan.npz")
    back = PackPlan.load(tmp_path / "plan.npz")
    assert back.cp_placement == "auto" and back.cost_model == plan.cost_model
    np.testing.assert_array_equal(back.a2a_packs, plan.a2a_packs)
    np.testing.assert_array_equal(back.placement.group_size, plan.placement.group_size)


def test_auto_without_a2a_heads_keeps_the_placement_or_te():
    """cp 3 does not divide Llama 3's 32 query heads: no pack is attended by all-to-all."""
    plan = plan_packs(_mixes(4)[0], 16380, cp_size=3, cp_placement="auto", overflow="split", **MODEL)
    assert not plan.a2a_packs.any()


def test_packs_carry_the_choice_into_the_batch_record():
    """build_pack adds cp_a2a to each pack of an auto plan; the batch's record keeps it through a
    shard; a batch is attended by all-to-all when all its packs chose it; a pack must choose once."""
    import torch

    from thdpack.cp import shard
    from thdpack.packing.packer import build_pack
    from thdpack.thd.batch import thd_collate

    plan, samples = mixed_auto_plan(4, 128)
    a2a, placed = int(np.flatnonzero(plan.a2a_packs)[0]), int(np.flatnonzero(~plan.a2a_packs)[0])
    packs = [build_pack(samples, plan, i) for i in (a2a, placed)]
    assert packs[0]["cp_a2a"].tolist() == [1] * len(packs[0]["seq_lens"]) and not packs[1]["cp_a2a"].any()
    for chosen, expect in (([packs[0]], True), ([packs[1]], False), (packs, False)):
        record = shard(thd_collate(chosen), 4, 1)["thd_meta"]
        assert record.groups.all_to_all is expect and record.groups.a2a_S is not None
    assert "a2a=(1," in repr(thd_collate([packs[0]])["thd_meta"])
    bad = dict(packs[0], cp_a2a=torch.tensor([1] + [0] * (len(packs[0]["seq_lens"]) - 1)))
    with pytest.raises(ValueError, match="pack 0: cp_a2a differs between its entries; all-to-all is chosen per pack"):
        thd_collate([bad])
