"""PackPlan: indexing, segments, and the compact save / load round trip."""

from __future__ import annotations

import numpy as np
import pytest

from thdpack.plan import PackPlan, plan_packs


@pytest.mark.parametrize("overflow", ["error", "split", "truncate", "drop"])
def test_save_load_round_trip(tmp_path, overflow):
    lengths = np.random.default_rng(0).integers(1, 700, 500)
    if overflow == "error":
        lengths = np.minimum(lengths, 512)
    plan = plan_packs(lengths, 512, overflow=overflow, cp_size=2)
    path = tmp_path / "plan.npz"
    plan.save(path)
    back = PackPlan.load(path)
    assert len(back) == len(plan)
    for i in range(len(plan)):
        for a, b in zip(plan.segments(i), back.segments(i), strict=True):
            assert np.array_equal(a, b)
    assert back.stats == plan.stats
    assert (back.pack_size, back.cp_size, back.algorithm, back.seed) == (512, 2, "bfd", None)
    assert back.indices.dtype == np.int64


def test_saved_file_is_compact(tmp_path):
    plan = plan_packs(np.random.default_rng(0).integers(1, 100, 10_000), 1024)
    plan.save(tmp_path / "plan.npz")
    # 10k uint16 indices + offsets + lengths + metadata
    assert (tmp_path / "plan.npz").stat().st_size < 10_000 * 2 * 3 + 4096


def test_indexing_and_iteration():
    plan = plan_packs([5, 3, 6, 2, 4], 10)
    assert [p.tolist() for p in plan] == [plan[0].tolist(), plan[1].tolist()]
    assert plan[-1].tolist() == plan[1].tolist()
    with pytest.raises(IndexError, match="pack 2 out of range for a plan of 2 packs"):
        plan[2]
    assert repr(plan) == "PackPlan(2 packs of 10 tokens, 5 entries, algorithm='bfd', cp_size=1)"


def test_load_rejects_other_files(tmp_path):
    np.savez(tmp_path / "other.npz", meta=np.array('{"format": "something"}'))
    with pytest.raises(ValueError, match="is not a thdpack plan"):
        PackPlan.load(tmp_path / "other.npz")
