"""CpTopology described without process groups: coordinates, rank lists, ranks per node, the
refusals. The topology made with process groups (create / from_groups) is tested on real ranks:
tests/distributed/test_cp_topology.py."""

from __future__ import annotations

import pytest

from thdpack.cp.topology import CpTopology, dp_size_for


def test_rank_r_is_cp_rank_r_mod_cp_of_replica_r_div_cp():
    coordinates = [CpTopology(dp_size=2, cp_size=4, rank=r, gpus_per_node=8) for r in range(8)]
    assert [(t.dp_rank, t.cp_rank) for t in coordinates] == [(r // 4, r % 4) for r in range(8)]
    topology = coordinates[6]
    assert (topology.world_size, topology.grad_average_size, topology.gpus_per_node) == (8, 8, 8)
    assert topology.cp_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topology.dp_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert 6 in topology.cp_groups[topology.dp_rank] and 6 in topology.dp_groups[topology.cp_rank]


def test_every_rank_is_in_one_cp_group_and_one_dp_group():
    for dp_size, cp_size in [(1, 1), (3, 1), (1, 6), (4, 2), (2, 8)]:
        topology = CpTopology(dp_size=dp_size, cp_size=cp_size, rank=0, gpus_per_node=1)
        world = list(range(dp_size * cp_size))
        assert sorted(r for group in topology.cp_groups for r in group) == world
        assert sorted(r for group in topology.dp_groups for r in group) == world
        assert [len(g) for g in topology.cp_groups] == [cp_size] * dp_size
        assert [len(g) for g in topology.dp_groups] == [dp_size] * cp_size


def test_single_is_one_process_without_groups():
    single = CpTopology.single()
    assert (single.dp_size, single.cp_size, single.rank, single.world_size, single.gpus_per_node) == (1, 1, 0, 1, 1)
    assert (single.cp_group, single.dp_group, single.dp_cp_group, single.mesh) == (None, None, None, None)
    assert single.placement_groups == {} and single.cp_groups == [[0]] and single.dp_groups == [[0]]
    assert single == CpTopology(dp_size=1, cp_size=1, rank=0, gpus_per_node=1)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"cp_size": 0}, ValueError, "cp_size must be >= 1, got 0"),
        ({"dp_size": 2.0}, TypeError, "dp_size must be an integer, got 2.0"),
        ({"rank": -1}, ValueError, "rank must be >= 0, got -1"),
        ({"rank": 8}, ValueError, r"rank=8 is outside dp_size=2 x cp_size=4 = 8 ranks; use a rank in 0..7"),
        ({"gpus_per_node": 0}, ValueError, "gpus_per_node must be >= 1, got 0"),
        ({"gpus_per_node": 3}, ValueError, r"8 ranks \(dp 2 x cp 4\) are not whole nodes of gpus_per_node=3"),
    ],
)
def test_bad_sizes_are_refused_with_the_fix(kwargs, error, message):
    with pytest.raises(error, match=message):
        CpTopology(**{"dp_size": 2, "cp_size": 4, "rank": 0, "gpus_per_node": 8, **kwargs})


def test_a_mesh_smaller_than_a_node_or_of_whole_nodes_is_accepted():
    assert CpTopology(dp_size=1, cp_size=2, rank=1, gpus_per_node=8).world_size == 2
    assert CpTopology(dp_size=4, cp_size=8, rank=31, gpus_per_node=8).dp_rank == 3


def test_the_dp_size_of_a_world():
    assert dp_size_for(8, 2) == 4 and dp_size_for(3, 3) == 1
    with pytest.raises(ValueError, match=r"cp_size=4 does not divide the world size 6; launch a multiple of 4"):
        dp_size_for(6, 4)


@pytest.mark.parametrize(
    ("start", "size", "message"),
    [
        (0, 8, r"this CpTopology has no process groups \(a described mesh\); make it with CpTopology.create"),
        (4, 4, r"this CpTopology has no process groups \(a described mesh\)"),
    ],
)
def test_a_described_mesh_has_no_process_group(start, size, message):
    topology = CpTopology(dp_size=1, cp_size=8, rank=5, gpus_per_node=8)
    with pytest.raises(ValueError, match=message):
        topology.group(start, size)


def test_create_needs_torch_distributed():
    with pytest.raises(ValueError, match=r"call torch.distributed.init_process_group first, or describe the mesh"):
        CpTopology.create(2, device_type="cpu")


def test_group_finds_the_cp_group_or_a_placement_group_and_names_the_fix():
    """``group`` only looks the groups up, so stand-ins for process groups serve here."""
    cp, quad, pair = object(), object(), object()
    groups = {(4, 4): quad, (4, 2): pair}
    topology = CpTopology(dp_size=1, cp_size=8, rank=5, gpus_per_node=8, cp_group=cp, placement_groups=groups)
    assert (topology.group(0, 8), topology.group(4, 4), topology.group(4, 2)) == (cp, quad, pair)
    refusals = [
        ((0, 4), r"CP ranks 0..3 do not include this process \(CP rank 5\)"),
        ((6, 2), r"CP ranks 6..7 do not include this process"),
        ((3, 2), r"CP ranks 3..4 are no aligned group of cp_size=8; a group has 2, 4, 8 ranks and starts at a"),
        ((4, 3), r"CP ranks 4..6 are no aligned group"),
        ((5, 1), r"CP ranks 5..5 are no aligned group"),
        ((8, 8), r"CP ranks 8..15 are no aligned group"),
    ]
    for (start, size), message in refusals:
        with pytest.raises(ValueError, match=message):
            topology.group(start, size)
    without = CpTopology(dp_size=1, cp_size=8, rank=5, gpus_per_node=8, cp_group=cp)
    assert without.group(0, 8) is cp
    with pytest.raises(ValueError, match=r"made without placement groups, and CP ranks 4..5 need one; make it with"):
        without.group(4, 2)
