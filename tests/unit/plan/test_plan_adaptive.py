"""plan_packs(cp_placement="adaptive"): every sequence placed once, within budgets, never costlier
than Transformer Engine's layout, never more packs than te, deterministic, saved and loaded."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from thdpack.layout.placement import CpPlacement
from thdpack.layout.rules import group_options, round_up_to_cp
from thdpack.plan import PackPlan, plan_packs
from thdpack.plan.adaptive import plan_adaptive
from thdpack.plan.cp_cost import rank_costs, split_cost
from thdpack.plan.place import place_rows


def _te_busiest(placement: CpPlacement, cost_model: str) -> np.ndarray:
    """(P,) the busiest rank of TE's layout of each pack's sequences."""
    te = CpPlacement.all_split(placement.offsets, placement.lengths, cp_size=placement.cp_size,
                               pack_size=placement.pack_size)  # fmt: skip
    return rank_costs(te, cost_model).max(axis=1)


def _check(plan: PackPlan, lengths: np.ndarray, cost_model: str, window: int = 1024) -> None:
    placement = plan.placement
    assert placement is not None and plan.cp_placement == "adaptive"
    assert sorted(plan.indices.tolist()) == list(range(len(lengths)))  # every sequence placed exactly once
    assert np.array_equal(placement.lengths, lengths[plan.indices])
    placement.validate(sequence_ids=plan.indices)  # groups allowed and aligned, no rank over budget
    busiest = rank_costs(placement, cost_model).max(axis=1)
    assert (busiest <= _te_busiest(placement, cost_model)).all()  # never worse than TE, per pack
    te = plan_packs(lengths, plan.pack_size, cp_size=plan.cp_size, algorithm=plan.algorithm, seed=plan.seed,
                    window=window)  # fmt: skip
    assert len(plan) <= len(te)
    stats = plan.stats
    assert stats.num_packs == len(plan) and stats.real_tokens == int(lengths.sum())
    assert stats.cp_padding_tokens == placement.cp_padding_tokens
    assert stats.cp_size == plan.cp_size


lengths_mixes = st.lists(
    st.one_of(st.integers(1, 64), st.integers(1, 300), st.integers(200, 1024)), min_size=1, max_size=120
)


@given(lengths_mixes, st.sampled_from([2, 3, 4, 8]), st.sampled_from(["tiles", "pairs"]))
def test_adaptive_plans_are_valid_and_never_worse_than_te(lengths, cp, cost_model):
    lengths = np.array(lengths)
    pack_size = 1024 if cp != 3 else 1032
    plan = plan_packs(lengths, pack_size, cp_size=cp, cp_placement="adaptive", cost_model=cost_model)
    _check(plan, lengths, cost_model)


@given(lengths_mixes, st.sampled_from([2, 4]), st.sampled_from(["ffd", "sequential", "window"]))
def test_every_algorithm_plans_adaptively(lengths, cp, algorithm):
    lengths = np.array(lengths)
    plan = plan_packs(lengths, 1024, cp_size=cp, algorithm=algorithm, window=16, cp_placement="adaptive")
    _check(plan, lengths, "tiles", window=16)
    if algorithm == "sequential":  # the order-preserving packs stay TE's packs, in order
        te = plan_packs(lengths, 1024, cp_size=cp, algorithm="sequential")
        assert [p.tolist() for p in plan] == [p.tolist() for p in te]


@given(st.lists(st.integers(1, 3000), min_size=1, max_size=60), st.sampled_from([2, 4]))
def test_overflow_split_entries_are_placed(lengths, cp):
    lengths = np.array(lengths)
    plan = plan_packs(lengths, 1024, cp_size=cp, overflow="split", cp_placement="adaptive")
    entries = plan.entry_lengths_flat()
    assert int(entries.sum()) == int(lengths.sum())
    plan.placement.validate()
    assert (rank_costs(plan.placement).max(axis=1) <= _te_busiest(plan.placement, "tiles")).all()


def test_short_sequences_go_whole_and_need_no_cp_padding():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, 3000)  # all below whole_limit(4, "tiles") = 256
    plan = plan_packs(lengths, 4096, cp_size=4, cp_placement="adaptive")
    te = plan_packs(lengths, 4096, cp_size=4)
    assert (plan.placement.group_size == 1).all() and plan.stats.cp_padding_tokens == 0
    assert len(plan) < len(te)  # TE's CP padding cost packs
    assert rank_costs(plan.placement).max(axis=1).sum() < 0.3 * _te_busiest(plan.placement, "tiles").sum()


def test_long_sequences_keep_te_layout_when_nothing_better_exists():
    lengths = np.full(10, 4096)  # one sequence per pack: split over all ranks is best
    plan = plan_packs(lengths, 4096, cp_size=4, cp_placement="adaptive")
    assert len(plan) == 10 and (plan.placement.group_size == 4).all()


def test_intermediate_groups_are_used_and_can_be_left_out():
    rng = np.random.default_rng(1)
    lengths = rng.integers(300, 3000, 400)
    full = plan_adaptive(lengths, 8192, 8, fit="bfd", rng=None, cost_model="tiles")
    ends = plan_adaptive(lengths, 8192, 8, fit="bfd", rng=None, cost_model="tiles", sizes=(1, 8))
    assert set(np.unique(full.group_size).tolist()) > {1, 8}
    assert set(np.unique(ends.group_size).tolist()) <= {1, 8}


def test_deterministic_and_seeded():
    lengths = np.random.default_rng(2).integers(1, 2000, 2000)
    a = plan_packs(lengths, 4096, cp_size=4, cp_placement="adaptive")
    b = plan_packs(lengths, 4096, cp_size=4, cp_placement="adaptive")
    assert np.array_equal(a.indices, b.indices) and np.array_equal(a.placement.group_size, b.placement.group_size)
    assert np.array_equal(a.placement.group_start, b.placement.group_start)
    c = plan_packs(lengths, 4096, cp_size=4, cp_placement="adaptive", seed=5)
    d = plan_packs(lengths, 4096, cp_size=4, cp_placement="adaptive", seed=5)
    assert np.array_equal(c.indices, d.indices) and np.array_equal(c.placement.group_start, d.placement.group_start)
    c.placement.validate()


def test_save_load_round_trip(tmp_path):
    lengths = np.random.default_rng(3).integers(1, 3000, 700)
    plan = plan_packs(lengths, 2048, cp_size=4, overflow="split", cp_placement="adaptive", cost_model="pairs")
    plan.save(tmp_path / "plan.npz")
    back = PackPlan.load(tmp_path / "plan.npz")
    assert back.cp_placement == "adaptive" and back.cost_model == "pairs"
    for name in ("offsets", "lengths", "group_size", "group_start"):
        assert np.array_equal(getattr(back.placement, name), getattr(plan.placement, name))
    assert back.stats == plan.stats
    te = plan_packs(lengths, 2048, cp_size=4, overflow="split")
    te.save(tmp_path / "te.npz")
    assert PackPlan.load(tmp_path / "te.npz").placement is None


def test_load_rejects_a_damaged_placement(tmp_path):
    plan = plan_packs(np.full(8, 100), 1024, cp_size=4, cp_placement="adaptive")
    plan.save(tmp_path / "plan.npz")
    with np.load(tmp_path / "plan.npz") as data:
        arrays = dict(data)
    arrays["cp_group_size"] = np.full_like(arrays["cp_group_size"], 3)
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError, match="placed on a group of 3 ranks"):
        PackPlan.load(tmp_path / "bad.npz")


def test_te_mode_and_cp_1_carry_no_placement():
    assert plan_packs([5, 3, 6], 16, cp_size=2).placement is None
    plan = plan_packs([5, 3, 6], 16, cp_placement="adaptive")
    assert plan.placement is None and plan.cp_placement == "te"
    with pytest.raises(ValueError, match="unknown cp_placement 'ring'; valid: te, adaptive, auto"):
        plan_packs([5], 16, cp_placement="ring")
    with pytest.raises(ValueError, match="unknown cost_model 'flops'; valid: tiles, pairs, time"):
        plan_packs([5], 16, cost_model="flops")


@given(
    st.lists(st.lists(st.integers(1, 600), min_size=1, max_size=12), min_size=1, max_size=6),
    st.sampled_from([2, 4, 8]),
    st.sampled_from(["tiles", "pairs"]),
)
def test_place_rows_fits_and_is_never_worse_than_all_split(rows, cp, cost_model):
    width = max(map(len, rows))
    lengths = np.zeros((len(rows), width), dtype=np.int64)
    for k, row in enumerate(rows):
        lengths[k, : len(row)] = sorted(row, reverse=True)
    reserve = np.where(lengths > 0, round_up_to_cp(lengths, cp), 0)
    budget = int(reserve.sum(axis=1).max()) // cp + 2
    budget += budget % 2
    option, tokens, cost, te_cost = place_rows(lengths, reserve, lengths > 0, cp_size=cp, budget=budget,
                                               cost_model=cost_model)  # fmt: skip
    assert (tokens <= budget).all()
    assert (cost.max(axis=1) <= te_cost.max(axis=1)).all()
    size_O, _ = group_options(cp)
    assert ((option >= 0) == (lengths > 0)).all()
    for k in range(len(rows)):  # the reported TE cost is TE's layout of the row
        n = lengths[k][lengths[k] > 0]
        assert te_cost[k].tolist() == split_cost(n, round_up_to_cp(n, cp), cp, cost_model).sum(axis=0).tolist()
        assert size_O[option[k][lengths[k] > 0]].min() >= 1
