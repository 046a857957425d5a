"""PackingRuntime: the run's values beside a packing config, typed, frozen and checked once."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from thdpack.packing import PackedDatasetConfig, PackingRuntime, StreamingPackerConfig
from thdpack.plan import PlanConfig

SAMPLES = [{"input_ids": list(range(1, n + 1))} for n in (3, 5, 2, 6, 4, 7)]


def test_from_topology_reads_the_dp_x_cp_place():
    """Any topology with cp_size, dp_size and dp_rank (the trainer's Runtime, the integrations'
    CpTopology) gives the runtime; the pad id comes from the tokenizer."""
    topology = SimpleNamespace(cp_size=2, dp_size=3, dp_rank=1, cp_rank=0)
    assert PackingRuntime.from_topology(topology, pad_id=50256) == PackingRuntime(
        cp_size=2, dp_rank=1, dp_size=3, pad_id=50256
    )


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"cp_size": 0}, ValueError, "cp_size must be >= 1, got 0"),
        ({"cp_size": 2.0}, TypeError, r"cp_size must be an integer, got 2\.0"),
        ({"dp_rank": -1}, ValueError, "dp_rank must be >= 0, got -1"),
        ({"dp_size": True}, TypeError, "dp_size must be an integer, got True"),
        ({"dp_rank": 3, "dp_size": 3}, ValueError, r"dp_rank=3 is not a rank of dp_size=3 .*; it must be in \[0, 3\)"),
        ({"pad_id": "0"}, TypeError, "pad_id must be an integer token id, got '0'"),
    ],
)
def test_a_bad_value_is_refused_naming_it(fields, error, message):
    with pytest.raises(error, match=message):
        PackingRuntime(**fields)
    place = {"cp_size": 1, "dp_size": 4, "dp_rank": 0, **fields}
    with pytest.raises(error, match=message):
        PackingRuntime.from_topology(SimpleNamespace(**place), pad_id=place.pop("pad_id", 0))


def test_it_is_frozen_and_normalises_numpy_integers():
    import numpy as np

    runtime = PackingRuntime(cp_size=np.int64(2), pad_id=np.int32(7))
    assert (type(runtime.cp_size), type(runtime.pad_id)) == (int, int)
    with pytest.raises(dataclasses.FrozenInstanceError):
        runtime.cp_size = 4  # type: ignore[misc]


def test_both_components_take_it():
    runtime = PackingRuntime(cp_size=2, dp_rank=1, dp_size=2, pad_id=9)
    dataset = PackedDatasetConfig(plan=PlanConfig(pack_size=16, seed=0)).build(SAMPLES, runtime)
    packer = StreamingPackerConfig(pack_size=16, buffer_size=4).build(SAMPLES, runtime)
    assert dataset.runtime == runtime
    assert (packer.runtime.cp_size, packer.runtime.pad_id) == (2, 9)  # the source is sharded per DP rank, not it
    assert all(p["seq_lens_padded"].remainder(4).eq(0).all() for p in packer)


def test_a_timing_without_the_planner_s_methods_is_refused_naming_them():
    """A timing prices sequences and each group's call (the placement search) and chooses each
    pack's way (auto): an object lacking any of it is refused before planning."""
    partial = SimpleNamespace(whole=len, split=len, choose=len, digest=len)
    with pytest.raises(TypeError, match=r"timing must be a timing model .* got SimpleNamespace without call, host_lead"):
        PackingRuntime(cp_size=2, timing=partial)
