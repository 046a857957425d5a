"""CpTopology on real gloo ranks: the groups it makes hold the right ranks, placed attention through
it equals the single-rank oracle, and two topologies in one process share nothing.

One launch of 4 ranks makes, in order: dp 2 x cp 2, cp 4 (its placement groups: the pairs
{0, 1}, {2, 3}), a second cp 4 without placement groups, and a topology around the dp 2 x cp 2 CP
group (``from_groups``, as the Trainer integration adopts accelerate's). Each rank reports the
ranks of every group it holds and its coordinates; then it runs the placed batches of
``support.placement_cases.MIXED_PACKS`` (cp 4: sequences split over all ranks and over pairs, cp 2: over
both ranks) forward and backward through each topology, interleaved, and returns its shard's
results for the parent to compare with the per-sequence fp64 oracle. The topology made without
placement groups refuses the pair-split batch on every rank before any collective, while the
other cp 4 topology in the same process runs it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from thdpack.attention import thd_attention
from thdpack.cp import shard
from thdpack.cp.topology import CpTopology
from thdpack.loss import StepLoss
from thdpack.testing import run_distributed

from support.attention_cases import random_case, reference_results, worst_errors
from support.placement_cases import MIXED_PACKS, placed_metadata, shard_rows

pytestmark = pytest.mark.distributed

WORLD = 4


def _ranks(group) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def _facts(topology: CpTopology) -> dict:
    return {
        "coordinates": (topology.dp_size, topology.cp_size, topology.dp_rank, topology.cp_rank),
        "cp": _ranks(topology.cp_group),
        "dp": _ranks(topology.dp_group),
        "dp_cp": _ranks(topology.dp_cp_group),
        "placement": {key: _ranks(group) for key, group in topology.placement_groups.items()},
        "mesh": None if topology.mesh is None else list(topology.mesh.get_coordinate()),
        "gpus_per_node": topology.gpus_per_node,
    }


def _case(cp_size: int) -> tuple[dict, dict]:
    thd = placed_metadata(MIXED_PACKS[cp_size])
    return thd, random_case(thd, 4, 2, 8, torch.float64, seed=cp_size)


def _placed_attention(topology: CpTopology) -> tuple[torch.Tensor, dict]:
    """This rank's rows and the out / lse / dq / dk / dv of its shard of the cp-size batch."""
    thd, case = _case(topology.cp_size)
    local = shard(thd, topology.cp_size, topology.cp_rank)
    index = shard_rows(local)
    q, k, v = (case[n][index].clone().requires_grad_() for n in ("q", "k", "v"))
    out, lse = thd_attention(q, k, v, local, cp_group=topology, backend="math", return_lse=True)
    loss = (out * case["dout"][index]).sum() + (lse * case["dlse"][:, index]).sum()
    got = {"out": out.detach(), "lse": lse.detach()}
    got.update(zip(("dq", "dk", "dv"), torch.autograd.grad(loss, (q, k, v)), strict=True))
    return index, got


def _rank_main(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    dp2_cp2 = CpTopology.create(2, device_type="cpu")
    cp4 = CpTopology.create(4, device_type="cpu")
    cp4_bare = CpTopology.create(4, device_type="cpu", placement_groups=False)
    adopted = CpTopology.from_groups(cp_group=dp2_cp2.cp_group, placement_groups=False)
    named = {"dp2_cp2": dp2_cp2, "cp4": cp4, "cp4_bare": cp4_bare, "adopted": adopted}
    out: dict = {"facts": {name: _facts(topology) for name, topology in named.items()}}
    out["runs"] = [("cp4", _placed_attention(cp4)), ("dp2_cp2", _placed_attention(dp2_cp2))]
    try:
        _placed_attention(cp4_bare)
        out["bare"] = "accepted"
    except ValueError as err:
        out["bare"] = str(err)
    out["runs"] += [("cp4 again", _placed_attention(cp4)), ("adopted", _placed_attention(adopted))]
    loss = StepLoss.begin([torch.tensor([1, -100, 2][: rank + 1])], topology=dp2_cp2)
    out["loss_tokens"] = (float(loss.denominator), int(loss.loss_tokens), loss.grad_average_size)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_rank_main, WORLD)


def test_the_groups_hold_the_right_ranks(ranks):
    for rank, got in enumerate(ranks):
        dp_rank, cp_rank = divmod(rank, 2)
        pair = [2 * dp_rank, 2 * dp_rank + 1]
        assert got["facts"]["dp2_cp2"] == {
            "coordinates": (2, 2, dp_rank, cp_rank),
            "cp": pair,
            "dp": [cp_rank, cp_rank + 2],
            "dp_cp": [0, 1, 2, 3],
            "placement": {},  # cp 2 has no group between one rank and both
            "mesh": [dp_rank, cp_rank],
            "gpus_per_node": WORLD,  # spawned on this machine: every rank on one node
        }
        assert got["facts"]["cp4"] == {
            "coordinates": (1, 4, 0, rank),
            "cp": [0, 1, 2, 3],
            "dp": [rank],
            "dp_cp": [0, 1, 2, 3],
            "placement": {(2 * dp_rank, 2): pair},  # its pair, nothing else
            "mesh": [0, rank],
            "gpus_per_node": WORLD,
        }
        assert got["facts"]["cp4_bare"] == {**got["facts"]["cp4"], "placement": {}}
        assert got["facts"]["adopted"] == {**got["facts"]["dp2_cp2"], "dp": None, "mesh": None}


def test_placed_attention_through_the_topology_equals_the_oracle(ranks):
    for name, cp_size in [("cp4", 4), ("cp4 again", 4), ("dp2_cp2", 2), ("adopted", 2)]:
        thd, case = _case(cp_size)
        want = reference_results(case, thd, causal=True)
        shards = [dict(got["runs"])[name] for got in ranks]
        # cp 2 runs on both pairs: every row twice over
        assert sorted(torch.cat([i for i, _ in shards]).tolist()) == sorted(
            list(range(len(case["valid"]))) * (WORLD // cp_size)
        )
        worst = worst_errors(shards, want, case["valid"])
        assert set(worst) == {"out", "lse", "dq", "dk", "dv"}
        assert max(worst.values()) <= 1e-10, (name, worst)


def test_a_topology_without_placement_groups_refuses_a_pair_split_batch_on_every_rank(ranks):
    for got in ranks:
        assert "this CpTopology was made without placement groups, and CP ranks" in got["bare"], got["bare"]


def test_the_loss_reduces_over_every_rank_of_the_topology(ranks):
    # ranks hold 1, 1, 2, 2 loss tokens ([1], [1, -100], [1, -100, 2], [1, -100, 2])
    assert [got["loss_tokens"] for got in ranks] == [(6.0, 6, 4)] * WORLD
