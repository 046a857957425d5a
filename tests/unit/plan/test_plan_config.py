"""PlanConfig: the plan's settings, checked once, one error class per fault wherever a plan is set up."""

from __future__ import annotations

import dataclasses

import pytest

from thdpack.packing import PackedDataset, StreamingPacker
from thdpack.plan import PlanConfig, plan_packs, plan_with

SAMPLES = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]


def test_plan_packs_is_plan_with_its_config():
    lengths = [5, 3, 6, 2, 4, 9, 1]
    config = PlanConfig(pack_size=12, algorithm="window", overflow="split", window=3, seed=4)
    a = plan_packs(lengths, 12, algorithm="window", cp_size=2, overflow="split", seed=4, window=3)
    b = plan_with(lengths, config, cp_size=2)
    assert [p.tolist() for p in a] == [p.tolist() for p in b] and (a.cp_size, a.seed) == (b.cp_size, b.seed) == (2, 4)


ENTRY_POINTS = {
    "plan_packs": lambda value: plan_packs([3, 2], value),
    "PlanConfig": lambda value: PlanConfig(pack_size=value),
    "PackedDataset": lambda value: PackedDataset(SAMPLES, value),
    "StreamingPacker": lambda value: StreamingPacker(SAMPLES, value),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize(
    ("value", "error"), [(20.5, TypeError), (20.0, TypeError), ("20", TypeError), (True, TypeError), (0, ValueError)]
)
def test_one_fault_one_error_class_everywhere(entry, value, error):
    """A bad pack_size raises the same class from every entry point that takes one."""
    with pytest.raises(error, match="pack_size must be"):
        ENTRY_POINTS[entry](value)


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"algorithm": "nf"}, ValueError, "unknown algorithm 'nf'; valid: bfd, ffd, sequential, window"),
        ({"overflow": "wrap"}, ValueError, "unknown overflow policy 'wrap'; valid: error, drop, truncate, split"),
        ({"window": 0}, ValueError, "window must be >= 1, got 0"),
        ({"seed": -1}, ValueError, "seed must be >= 0, got -1"),
        ({"seed": 1.5}, TypeError, "seed must be an integer, got 1.5"),
        ({"pack_size": 2**41}, ValueError, "over the largest pack thdpack plans"),
    ],
)
def test_bad_settings(fields, error, message):
    with pytest.raises(error, match=message):
        PlanConfig(**{"pack_size": 64, **fields})


def test_the_cp_size_is_not_a_setting_and_is_checked_where_it_meets_the_pack_size():
    assert "cp_size" not in {f.name for f in dataclasses.fields(PlanConfig)}
    config = PlanConfig(pack_size=30)
    with pytest.raises(ValueError, match=r"pack_size=30 is not a multiple of 2\*cp_size=4"):
        plan_with([3], config, cp_size=2)
    with pytest.raises(TypeError, match=r"cp_size must be an integer, got 2\.0"):
        plan_with([3], config, cp_size=2.0)


def test_settings_are_plain_values():
    import numpy as np

    config = PlanConfig(pack_size=np.int64(64), window=np.int32(8), seed=np.int64(3))
    assert config.fingerprint() == {
        "pack_size": 64,
        "algorithm": "bfd",
        "overflow": "error",
        "window": 8,
        "seed": 3,
        "cp_placement": "te",
        "cost_model": "tiles",
        "improve": True,
    }
    assert all(type(v) in (int, str, bool) for v in config.fingerprint().values())
