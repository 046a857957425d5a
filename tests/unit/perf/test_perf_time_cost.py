"""The ``time`` cost model: a pack's time cost is the step model's attention + comm + host part of
it (each sequence alone in its group, each group's call once, device and host combined as the step
model combines them), groups across nodes cost the network, and the placement search prefers
groups inside one node and, where the host is the bottleneck, sees its ops."""

from __future__ import annotations

import json

import numpy as np
import pytest

from thdpack.layout.placement import CpPlacement
from thdpack.layout.rules import group_options, round_up_to_cp, slot_lengths
from thdpack.packing.dealing import Epochs
from thdpack.perf.auto import pack_seconds
from thdpack.perf.comm import Topology
from thdpack.perf.machine import load_profile
from thdpack.perf.megatron import MEGATRON_SPEC, lognormal_lengths
from thdpack.perf.mesh import placed_run
from thdpack.perf.shape import load_shape
from thdpack.perf.step import StepModel
from thdpack.perf.time_cost import TimeCostModel, timing_of
from thdpack.plan import PlanConfig, plan_packs
from thdpack.plan.adaptive import plan_entries
from thdpack.plan.api import plan_with
from thdpack.plan.cp_cost import rank_costs, split_cost, whole_cost, whole_limit
from thdpack.plan.place import place_rows


def _alone(cost: TimeCostModel, length: int, g: int) -> np.ndarray:
    """(g,) the step model's attention + exposed seconds per rank of one sequence alone in a group
    of ``g`` (whole for ``g == 1``), less the fixed kernel-call costs."""
    run = placed_run(offsets=np.array([0, 1]), lengths=np.array([length]), group_size=np.array([g]),
                     group_start=np.array([0]), pack_step=np.array([0]), pack_round=np.array([0]),
                     pack_dp=np.array([0]), cp_size=g, dp_size=1, pack_size=g * 2 * length)  # fmt: skip
    model = cost.model
    times = model.group_times(run)
    calls = 1 if g == 1 else g
    forward, backward = model.costs.kernels.calls(calls)
    return times["attention"] + times["exposed"] - model.shape.layers * (forward + backward)


@pytest.mark.parametrize(("profile", "shape"), [("h100_sxm", "llama3-8b"), ("gb200_nvl72", "megatron-dcp-gpt")])
@pytest.mark.parametrize("gpus_per_node", [2, 8])
def test_per_sequence_costs_are_the_step_model_of_the_sequence_alone(profile, shape, gpus_per_node):
    cost = TimeCostModel.load(profile, shape, gpus_per_node)
    for length in (1, 77, 128, 1000, 4096, 30000):
        assert abs(int(whole_cost(np.array([length]), cost)[0]) - _alone(cost, length, 1)[0] * 1e9) <= 1
        for g in (2, 4, 8):
            slot = slot_lengths(np.array([length]), g)
            per_rank = split_cost(np.array([length]), slot, g, cost)[0]
            assert per_rank.dtype == np.int64 and len(set(per_rank.tolist())) == 1  # every rank the same
            np.testing.assert_allclose(per_rank, _alone(cost, length, g) * 1e9, atol=1)


def test_a_group_across_nodes_costs_the_network():
    inside, across = (TimeCostModel.load("h100_sxm", "llama3-8b", n) for n in (8, 4))
    lengths = np.array([2048, 16384])
    slots = slot_lengths(lengths, 8)
    assert (split_cost(lengths, slots, 8, across) > split_cost(lengths, slots, 8, inside)).all()
    slots = slot_lengths(lengths, 4)  # a group of 4 fits a node of 4: the same links
    np.testing.assert_array_equal(split_cost(lengths, slots, 4, across), split_cost(lengths, slots, 4, inside))


def _step_model_part(cost: TimeCostModel, placement: CpPlacement) -> np.ndarray:
    """(R,) the step model's attention + exposed communication + host part of each rank of the
    first pack of ``placement`` run alone: the rank's round less its linear work (and, where host
    and device add, less the host's ops beside the attention calls), in nanoseconds."""
    model = cost.model
    run = placed_run(offsets=placement.offsets[:2], lengths=placement.lengths[: placement.offsets[1]],
                     group_size=placement.group_size, group_start=placement.group_start, pack_step=np.array([0]),
                     pack_round=np.array([0]), pack_dp=np.array([0]), cp_size=placement.cp_size, dp_size=1,
                     pack_size=placement.pack_size)  # fmt: skip
    own = model.run(run).busy[0] - model.costs.kernels.linear(placement.pack_size // placement.cp_size)
    if not model.profile.host.asynchronous:
        own -= model.round_host_ops() * model.profile.host.op_s
    return own * 1e9


@pytest.mark.parametrize(
    ("profile", "shape", "pack_size"),
    [("h100_sxm", "llama3-8b", 65536), ("h100_sxm", "llama3-8b", 4096), ("gb200_nvl72", "megatron-dcp-gpt", 8192),
     ("docs/performance/calibrated_cpu.json", "megatron-dcp-gpt", 8192)],
)  # fmt: skip
def test_the_time_cost_of_a_pack_is_the_step_models_attention_comm_and_host(profile, shape, pack_size):
    """Whole sequences (two sharing rank 0's local call), one sequence over ranks 2-3, one over all
    four, on a device-bound pack (Llama 3 8B, 16k tokens per rank: the host hides behind the
    device), host-bound ones (1k tokens per rank; Megatron's GPT on Grace) and a CPU's (host and
    device add): each rank's time cost is the step model's attention + comm + host part of it."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    cost = TimeCostModel.load(root / profile if profile.endswith(".json") else profile, shape)
    b = pack_size // 4
    lengths = np.array([b // 4, b // 8, b // 2, b, 2 * b - 8])
    placement = CpPlacement(cp_size=4, pack_size=pack_size, offsets=np.array([0, 5]), lengths=lengths,
                            group_size=np.array([1, 1, 1, 2, 4]), group_start=np.array([0, 0, 1, 2, 0]))  # fmt: skip
    placement.validate()
    got = rank_costs(placement, cost)[0]
    np.testing.assert_allclose(got, _step_model_part(cost, placement), rtol=0, atol=8)  # one ns per rounded term
    # a group attending several sequences makes one call: two in the group of four cost one call more than one
    shared = CpPlacement(cp_size=4, pack_size=pack_size, offsets=np.array([0, 2]), lengths=np.array([b, b]),
                         group_size=np.array([4, 4]), group_start=np.array([0, 0]))  # fmt: skip
    alone = int(split_cost(np.array([b]), slot_lengths(np.array([b]), 4), 4, cost)[0, 0])
    device, host = cost.call(4)
    lead = cost.host_lead(b)
    combine = (lambda d, h: d + h) if lead is None else (lambda d, h: max(d, h + lead))
    assert rank_costs(shared, cost)[0].tolist() == [combine(2 * alone + device, host)] * 4
    # ... and the per-sequence rings (each with its sends' latency) bound the shared ring from above
    assert (rank_costs(shared, cost)[0] >= _step_model_part(cost, shared) - 8).all()


def test_a_group_s_call_costs_its_ring_steps_launches_and_host_ops():
    cost = TimeCostModel.load("h100_sxm", "llama3-8b")
    model = cost.model
    op_ns = model.profile.host.op_s * 1e9 * model.shape.layers
    launch_ns = model.profile.attention.call_overhead_s * 1e9 * model.shape.layers * 4  # 1 forward, 3 backward
    for g in (1, 2, 4, 8):
        device, host = cost.call(g)
        assert abs(device - g * launch_ns) <= 1
        assert abs(host - model.host.ring_ops(g).total * op_ns) <= 1
    assert cost.host_lead(8192) < 0 < cost.host_lead(256)  # 8k tokens of an 8B model outlast the host's ops
    assert TimeCostModel.load("docs/performance/calibrated_cpu.json", "llama3-8b").host_lead(8192) is None


class _SequencesAlone:
    """A time cost model's per-sequence costs without its calls: what the search would see blind to
    the launches and the host's ops of each group."""

    def __init__(self, cost: TimeCostModel) -> None:
        self.cost = cost

    def whole(self, lengths_S):
        return self.cost.whole(lengths_S)

    def split(self, lengths_S, slots_S, group_size):
        return self.cost.split(lengths_S, slots_S, group_size)

    def call(self, group_size):
        return 0, 0

    def host_lead(self, budget):
        return None


@pytest.mark.parametrize("cp", [4, 8, 16])
def test_the_search_sees_the_host_where_it_is_the_bottleneck(cp):
    """Megatron-LM's GPT on GB200's Grace host, 2,048 tokens per rank: the host's ops outlast the
    kernels, so each group a rank joins costs it a call's ops. Placed with them, the packs run
    faster by the step model than placed by the sequences' own costs alone."""
    profile = load_profile("gb200_nvl72")
    model = StepModel(profile, load_shape("megatron-dcp-gpt"), Topology.of(profile, 4), MEGATRON_SPEC)
    cost = TimeCostModel(model)
    assert cost.host_lead(2048) > 0  # host-bound
    lengths = lognormal_lengths(200 * cp, seed=cp) - 1

    def placed(costing):
        return plan_entries(lengths, cp * 2048, cp, algorithm="bfd", window=1024, rng=None, cost_model=costing)[2]

    assert pack_seconds(placed(cost), model).sum() < pack_seconds(placed(_SequencesAlone(cost)), model).sum()


def test_short_sequences_stay_whole_under_time():
    """Splitting a short sequence pays a send per ring step: the time model keeps far longer
    sequences whole than the tile count does."""
    cost = TimeCostModel.load("h100_sxm", "llama3-8b")
    assert whole_limit(8, cost) > whole_limit(8, "tiles")


def test_the_placement_prefers_groups_inside_one_node():
    """cp 8 on nodes of 4 GPUs: a group of all 8 crosses the network, so the time placement splits
    mid-length sequences over groups inside a node; on nodes of 8 it also uses all 8. (Rows with
    room to place: a full row fits only every sequence split over all ranks.)"""
    lengths = -np.sort(-np.random.default_rng(0).integers(4000, 12000, size=(200, 5)), axis=1)
    reserve = round_up_to_cp(lengths, 8)
    size_O, _ = group_options(8)
    used = {}
    for gpus_per_node in (8, 4):
        cost = TimeCostModel.load("h100_sxm", "llama3-8b", gpus_per_node)
        option, tokens, _, _ = place_rows(lengths, reserve, lengths > 0, cp_size=8, budget=8192, cost_model=cost)
        assert (tokens <= 8192).all()
        used[gpus_per_node] = np.bincount(size_O[option].ravel(), minlength=9)
    assert used[8][8] > 0 and used[4][8] == 0
    assert used[4][2] + used[4][4] > used[8][2] + used[8][4]  # split inside a node instead


def test_a_timed_plan_needs_its_machine_and_model_and_fingerprints_their_content(tmp_path):
    with pytest.raises(ValueError, match=r"cost_model='time' times packs .* but profile and model_shape are not set"):
        PlanConfig(pack_size=64, cost_model="time")
    with pytest.raises(ValueError, match=r"cp_placement='auto' times packs .* but model_shape is not set"):
        PlanConfig(pack_size=64, cp_placement="auto", profile="h100_sxm")
    with pytest.raises(TypeError, match="profile must be a non-empty string, got 3"):
        PlanConfig(pack_size=64, profile=3)
    assert "profile" not in PlanConfig(pack_size=64).fingerprint()  # untimed plans do not depend on it
    path = tmp_path / "mine.json"
    TimeCostModel.load("h100_sxm", "llama3-8b").model.profile.to_json(path)
    config = PlanConfig(pack_size=64, cost_model="time", cp_placement="adaptive", profile=str(path),
                        model_shape="llama3-8b")  # fmt: skip
    assert config.fingerprint()["profile"] == str(path)
    with pytest.raises(ValueError, match=r"times packs, but no timing was given; pass timing=thdpack\.perf\.time_cost"):
        plan_with(np.array([5, 9]), config, cp_size=2)

    def dataset_digest() -> str:
        epochs = Epochs(np.array([5, 9]), config, cp_size=2, shuffle=False, timing=timing_of(config))
        return epochs.fingerprint()["timing_sha256"]

    before = dataset_digest()
    data = json.loads(path.read_text())
    data["intra_node"]["bandwidth"] /= 2
    path.write_text(json.dumps(data))
    assert dataset_digest() != before  # the profile's name is the same, its content not
    assert timing_of(PlanConfig(pack_size=64)) is None


def test_plan_packs_plans_by_time():
    lengths = np.random.default_rng(1).integers(1, 4000, 2000)
    plan = plan_packs(lengths, 8192, cp_size=4, cp_placement="adaptive", cost_model="time", profile="h100_sxm",
                      model_shape="llama3-8b", timing=TimeCostModel.load("h100_sxm", "llama3-8b"))  # fmt: skip
    assert plan.cost_model == "time" and plan.cp_placement == "adaptive"
    plan.placement.validate(sequence_ids=plan.indices)
    assert sorted(plan.indices.tolist()) == list(range(len(lengths)))
