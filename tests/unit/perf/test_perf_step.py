"""The step model's pieces on hand-computed cases, and per-sequence costs adding up to the step.

The toy machine: 1000 FLOP/s everywhere (matmul and every attention curve flat from length 1),
no latency, no call cost; the toy model: one layer, one head of 4 (16 FLOPs per (query, key) pair
forward, 2.5x backward; 16 bytes of K/V per token).
"""

from __future__ import annotations

import numpy as np
import pytest

from thdpack.perf.comm import Comm, Topology
from thdpack.perf.costs import SequenceCosts
from thdpack.perf.machine import MachineProfile, load_profile
from thdpack.perf.megatron import lognormal_lengths
from thdpack.perf.mesh import COMMS, MeshRun, placed_run
from thdpack.perf.shape import ModelShape
from thdpack.perf.step import StepModel, TrainingSpec
from thdpack.plan import plan_packs

TOY = ModelShape(layers=1, hidden=4, ffn=4, heads=1, kv_heads=1, head_dim=4, vocab=4, gated_mlp=False)
ALONE = TrainingSpec(grad_itemsize=2, optimizer_bytes_per_param=0.0, overlap_dp=False)


def toy_profile(intra_bandwidth: float = 1000.0, inter_bandwidth: float = 10.0) -> MachineProfile:
    data = load_profile("h100_sxm").to_dict()
    flat = [[1, 1000.0], [1e6, 1000.0]]
    data.update(peak_flops=1000.0, matmul_efficiency=1.0, memory_bandwidth=1e9, collective_base_latency_s=0.0)
    data["attention"].update(tile=1, call_overhead_s=0.0, forward_causal=flat, forward_full=flat, backward=flat)
    data["intra_node"] = {"bandwidth": intra_bandwidth, "latency_s": 0.0}
    data["inter_node"] = {"bandwidth": inter_bandwidth, "latency_s": 0.0}
    data["gpus_per_node"] = data["nvlink_domain"] = 2
    return MachineProfile.from_dict(data)


def run_of(world: int, groups: list[tuple[int, int, int, str]], entries: list[tuple[int, int]], rounds: int = 1):
    """A one-step run: groups ``(round, first rank, size, comm)``, entries ``(group, length)``."""
    g = np.array([(r, f, s) for r, f, s, _ in groups]).reshape(-1, 3)
    e = np.array(entries).reshape(-1, 2)
    return MeshRun(
        world=world,
        steps=1,
        rounds=rounds,
        group_step=np.zeros(len(g), dtype=np.int64),
        group_round=g[:, 0],
        group_first=g[:, 1],
        group_size=g[:, 2],
        group_comm=np.array([COMMS.index(c) for *_, c in groups]),
        entry_group=e[:, 0],
        entry_length=e[:, 1],
        tokens=np.zeros((1, rounds, world)),
    )


def toy_model(profile: MachineProfile | None = None, world_per_node: int = 2) -> StepModel:
    profile = profile or toy_profile()
    return StepModel(profile, TOY, Topology(world_per_node, world_per_node), ALONE)


def test_ring_step_bound_by_compute_then_by_bandwidth():
    # one sequence of 8 over a ring of 2: chunk 2; step 0 a causal 4x4 tile (8 pairs, 128 FLOPs
    # forward: 0.128 s; backward 0.32 s), step 1 a full 4x2 tile (the same); each step sends 4
    # tokens' K/V (64 bytes), the backward also the dK/dV block (64 bytes) and its last hop
    run = run_of(2, [(0, 0, 2, "ring")], [(0, 8)])
    fast = toy_model(toy_profile(intra_bandwidth=1000.0)).group_times(run)  # a send: 0.064 s < the tile
    assert fast["attention"] == pytest.approx([0.896, 0.896])
    assert fast["exposed"] == pytest.approx([0.064, 0.064])  # only the final dK/dV hop
    slow = toy_model(toy_profile(intra_bandwidth=100.0)).group_times(run)  # a send: 0.64 s > the tile
    assert slow["attention"] == pytest.approx([0.896, 0.896])  # the same compute
    # forward max(0.128, 0.64) + 0.128 - 0.256 = 0.512; backward max(0.32, 1.28) + 0.32 + 0.64 - 0.64 = 1.6
    assert slow["exposed"] == pytest.approx([2.112, 2.112])


def test_a_group_spanning_nodes_is_slower_than_one_inside_a_node():
    model = toy_model(toy_profile(intra_bandwidth=1000.0, inter_bandwidth=10.0))
    inside = model.run(run_of(4, [(0, 0, 2, "ring")], [(0, 8)]))
    across = model.run(run_of(4, [(0, 1, 2, "ring")], [(0, 8)]))  # ranks 1 and 2: two nodes
    assert across.slowest[0] > inside.slowest[0]
    # across: every send of 64 bytes takes 6.4 s: forward 6.4 + 0.128, backward 12.8 + 0.32 + 6.4
    assert across.slowest[0] == pytest.approx(6.528 + 19.52)
    assert inside.slowest[0] == pytest.approx(0.896 + 0.064)


def test_the_barrier_wait_is_the_slowest_rank_minus_its_own():
    # two data-parallel ranks: 8 tokens whole (32 pairs: 0.512 + 1.28 s) against 4 (8 pairs: 0.448 s)
    model = toy_model()
    times = model.run(run_of(2, [(0, 0, 1, "whole"), (0, 1, 1, "whole")], [(0, 8), (1, 4)]))
    assert times.busy[0] == pytest.approx([1.792, 0.448])
    assert times.slowest[0] == pytest.approx(1.792)
    assert times.parts["wait"][0] == pytest.approx(((1.792 - 1.792) + (1.792 - 0.448)) / 2)
    # the gradient all-reduce of the toy model's 124 parameters in bf16 over 2 ranks at 1000 B/s
    assert TOY.parameters() == 124
    assert times.parts["dp"][0] == pytest.approx(2 * (1 / 2) * 124 * 2 / 1000)
    total = sum(times.parts[p][0] for p in times.parts)
    assert total == pytest.approx(times.step[0])


def test_groups_that_change_between_rounds_chain_their_waits():
    # round 0: 8 whole on rank 0 (1.792 s), 4 whole on rank 1 (0.448 s); round 1: a ring of 8 on
    # ranks 1-2 (0.896 s, fast links); round 2: a ring of 8 on ranks 2-3: rank 3 waits for rank 2
    fast = toy_profile(intra_bandwidth=1e12, inter_bandwidth=1e12)
    groups = [(0, 0, 1, "whole"), (0, 1, 1, "whole"), (1, 1, 2, "ring"), (2, 2, 2, "ring")]
    run = run_of(4, groups, [(0, 8), (1, 4), (2, 8), (3, 8)], rounds=3)
    times = toy_model(fast, world_per_node=4).run(run)
    assert times.busy[0] == pytest.approx([1.792, 0.448 + 0.896, 0.896 + 0.896, 0.896], rel=1e-6)
    assert times.slowest[0] == pytest.approx(0.448 + 0.896 + 0.896, rel=1e-6)
    assert times.parts["wait"][0] == pytest.approx(2.24 - np.mean(times.busy[0]), rel=1e-6)


def test_linear_work_follows_the_held_tokens():
    model = toy_model()
    run = run_of(2, [(0, 0, 1, "whole")], [(0, 4)])
    run.tokens[0, 0] = [10.0, 30.0]
    per_token = TOY.linear_flops_per_token() / 1000.0
    times = model.run(run)
    assert times.parts["linear"][0] == pytest.approx(20.0 * per_token)
    assert times.busy[0] == pytest.approx([10 * per_token + 0.448, 30 * per_token])


def test_the_a2a_exchange_moves_the_bytes_thdpack_a2a_counts():
    from thdpack.attention.a2a import a2a_bytes

    shape = ModelShape(layers=1, hidden=4096, ffn=1, heads=32, kv_heads=8, head_dim=128, vocab=1)
    for cp in (4, 16):
        copies = shape.kv_copies(cp)
        per_token = shape.qkv_bytes_per_token(copies) + shape.out_bytes_per_token()
        moved = 2 * (cp - 1) / cp * 2048 * per_token  # two all-to-alls forward, two backward
        assert moved == a2a_bytes(2048, cp, 32, 8, 128)


def test_per_sequence_costs_add_up_to_the_steps_attention():
    profile = load_profile("h100_sxm")
    shape = ModelShape(layers=4, hidden=1024, ffn=2816, heads=8, kv_heads=2, head_dim=128, vocab=1000)
    model = StepModel(profile, shape, Topology(8, 8))
    costs = SequenceCosts(profile, shape)
    lengths = lognormal_lengths(3000, seed=3, high=16384)
    plan = plan_packs(lengths, 4 * 8192, cp_size=4, cp_placement="adaptive")
    p = plan.placement
    packs = len(p)
    run = placed_run(offsets=p.offsets, lengths=p.lengths, group_size=p.group_size, group_start=p.group_start,
                     pack_step=np.arange(packs) // 2, pack_round=np.zeros(packs, np.int64),
                     pack_dp=np.arange(packs) % 2, cp_size=4, dp_size=2, pack_size=4 * 8192)  # fmt: skip
    times = model.run(run)
    whole = p.group_size == 1
    expected = costs.attention_whole(p.lengths[whole]).sum()
    for g in (2, 4):
        of_g = p.group_size == g
        expected += g * costs.attention_split(p.lengths[of_g], g)[:, 0].sum()
    # one call per layer for each rank's whole sequences, one per ring step for each split group
    worked = np.bincount(run.entry_group, minlength=len(run.group_size)) > 0
    calls = np.where(run.group_comm == COMMS.index("ring"), run.group_size**2, 1)[worked].sum()
    expected += shape.layers * calls * 4 * profile.attention.call_overhead_s
    assert float(times.parts["attention"].sum() * run.world) == pytest.approx(float(expected), rel=1e-9)
    # and split() is that attention plus the linear work of the rank's share of the slot
    assert costs.split(np.array([1001]), 4)[0, 0] == pytest.approx(
        costs.attention_split(np.array([1001]), 4)[0, 0] + float(costs.kernels.linear(1008 / 4))
    )


def test_collectives_follow_the_bus_bandwidth_factors():
    profile = toy_profile(intra_bandwidth=1000.0, inter_bandwidth=10.0)
    comm = Comm(profile, Topology(2, 2))
    assert comm.collective("all_reduce", 100.0, 4, np.array([1]))[0] == pytest.approx(2 * 0.75 * 100 / 1000)
    assert comm.collective("all_gather", 100.0, 4, np.array([2]))[0] == pytest.approx(0.75 * 100 / 10)
    assert comm.collective("all_to_all", 100.0, 1, np.array([1]))[0] == 0.0
    assert comm.send(np.array([50.0]), np.array([2]))[0] == pytest.approx(5.0)


def test_a_node_size_override_keeps_a_fabric_that_spans_nodes():
    gb200, h100 = load_profile("gb200_nvl72"), load_profile("h100_sxm")
    assert Topology.of(gb200, 4) == Topology(4, 72)
    assert Topology.of(h100, 4) == Topology(4, 4)
    assert Topology.of(h100) == Topology(8, 8)
    assert Topology(4, 72).domains(np.array([0, 68]), np.array([71, 75])).tolist() == [1, 2]


def test_all_gather_exchanges_every_ranks_kv_as_nccl_tests_counts_it():
    # one sequence of 8 over 2 ranks: each holds 4 tokens' K/V (64 bytes); the all-gather's output is
    # 128 bytes, of which (n-1)/n cross the link: 0.064 s at 1000 B/s; the dK/dV reduce-scatter the same
    exposed = toy_model().group_times(run_of(2, [(0, 0, 2, "allgather")], [(0, 8)]))["exposed"]
    assert exposed == pytest.approx([0.128, 0.128])
