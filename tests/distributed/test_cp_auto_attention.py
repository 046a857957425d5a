"""``cp_placement="auto"`` switches the attention per pack, exactly, in real processes (gloo).

One launch of 4 ranks covers cp 2 (both pairs, side by side) and cp 4. An ``auto`` plan whose packs
mix all-to-all and placed ones (lengths the model splits the choice on:
``support.placement_cases.mixed_auto_plan``) is built by thdpack's packer, each pack
collated, sharded by its placement and attended by ``thd_attention`` with the run's configured
``cp_comm_type="p2p"``: a pack the plan attends by all-to-all must run the all-to-all (and only it),
the others their placement; a batch of two packs with different choices runs its placement (the
long sequence's ring over all ranks beside the short ones whole).
Every result, forward and backward in fp64, is compared with the single-rank per-sequence oracle.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from thdpack.attention import thd_attention
from thdpack.cp import shard
from thdpack.cp.topology import CpTopology
from thdpack.packing.packer import build_pack
from thdpack.testing import run_distributed
from thdpack.thd.batch import thd_collate

from support.attention_cases import random_case, reference_results, worst_errors
from support.placement_cases import mixed_auto_plan, shard_rows

pytestmark = pytest.mark.distributed

PACK_SIZE, HEADS = 128, 4


def _batches(cp_size: int) -> list[tuple[str, dict, bool]]:
    """(name, global THD batch, whether all its packs are attended by all-to-all)."""
    plan, samples = mixed_auto_plan(cp_size, PACK_SIZE)
    packs = [build_pack(samples, plan, i) for i in range(len(plan))]
    out = [(f"pack {i}", thd_collate([p]), bool(plan.a2a_packs[i])) for i, p in enumerate(packs)]
    mixed = [int(np.flatnonzero(plan.a2a_packs)[0]), int(np.flatnonzero(~plan.a2a_packs)[0])]
    out.append(("two packs, both ways", thd_collate([packs[i] for i in mixed]), False))
    return out


def _attend(topology: CpTopology) -> list:
    cp_size, rank = topology.cp_size, topology.cp_rank
    results = []
    for n, (name, thd, a2a) in enumerate(_batches(cp_size)):
        case = random_case(thd, HEADS, 2, 8, torch.float64, seed=n)
        local = shard(thd, cp_size, rank)
        index = shard_rows(local)
        q, k, v = (case[key][index].clone().requires_grad_() for key in ("q", "k", "v"))
        calls, saved = [], dist.all_to_all_single

        def counted(*args, calls=calls, saved=saved, **kwargs):
            calls.append("a2a")
            return saved(*args, **kwargs)

        dist.all_to_all_single = counted
        try:
            out, lse = thd_attention(q, k, v, local, cp_group=topology, backend="math", cp_comm_type="p2p",
                                     return_lse=True)  # fmt: skip
            loss = (out * case["dout"][index]).sum() + (lse * case["dlse"][:, index]).sum()
            grads = torch.autograd.grad(loss, (q, k, v))
        finally:
            dist.all_to_all_single = saved
        got = {"out": out.detach(), "lse": lse.detach(), **dict(zip(("dq", "dk", "dv"), grads, strict=True))}
        results.append(((cp_size, name), a2a, bool(calls), index, got))
    return results


def _rank_main(rank: int, world_size: int) -> list:
    torch.set_num_threads(1)
    pairs = CpTopology.create(2, device_type="cpu")
    cp4 = CpTopology.create(4, device_type="cpu")
    return _attend(pairs) + _attend(cp4)


@pytest.fixture(scope="module")
def auto_runs() -> dict:
    runs: dict = {}
    for rank_out in run_distributed(_rank_main, 4):
        for key, a2a, called, index, got in rank_out:
            runs.setdefault(key, []).append((a2a, called, index, got))
    return runs


@pytest.mark.parametrize("cp_size", [2, 4])
def test_each_pack_runs_its_choice_exactly(auto_runs, cp_size):
    plan, _ = mixed_auto_plan(cp_size, PACK_SIZE)
    assert plan.a2a_packs.any() and not plan.a2a_packs.all()  # the plan mixes both ways
    batches = _batches(cp_size)
    for n, (name, thd, a2a) in enumerate(batches):
        shards = auto_runs[(cp_size, name)]
        assert len(shards) == 4  # cp 2 runs on both pairs
        assert all(called == a2a for _, called, _, _ in shards), (name, a2a)  # the all-to-all iff chosen
        case = random_case(thd, HEADS, 2, 8, torch.float64, seed=n)
        want = reference_results(case, thd, True)
        worst = worst_errors([(index, got) for _, _, index, got in shards], want, case["valid"])
        assert set(worst) == {"out", "lse", "dq", "dk", "dv"}
        assert max(worst.values()) <= 1e-10, (name, worst)
