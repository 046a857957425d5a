"""Context-parallel attention in real processes (gloo): ring and all-gather vs the oracle.

One launch of 4 ranks covers cp_size 1, 2 and 4 through subgroups (cp=2 runs two groups side by
side on different cases). Every rank builds the same global batch from a seed, shards it with
TE's partition, runs ``thd_attention(..., cp_group=...)`` forward and backward (a loss on the
output and on the LSE), and returns its shard's results; the parent compares them with the
per-sequence dense fp64 oracle on the real tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from thdpack.attention import ring as ring_module
from thdpack.attention import thd_attention
from thdpack.cp import shard
from thdpack.testing import run_distributed
from thdpack.thd import thd_collate
from thdpack.thd.carriage import thd_meta

from support.attention_cases import LENGTH_MIXES, make_thd, random_case, reference_results, shard_of, worst_errors

pytestmark = pytest.mark.distributed

# (length mix, causal, (Nq, Nkv), dtype, extra tail padding in units of 2*cp)
CASES = [
    ("exactly 2cp", True, (4, 2), torch.float64, 0),
    ("length 1 padded", True, (2, 2), torch.float64, 1),
    ("long + many short", True, (4, 1), torch.float64, 0),
    ("not divisible", False, (4, 2), torch.float64, 1),
    ("identical", False, (2, 2), torch.float64, 0),
    ("long + many short", False, (4, 2), torch.float32, 0),
    ("not divisible", True, (4, 4), torch.float32, 2),
]
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
MUTANTS = ("mutant: wrong tile for src > rank", "mutant: shard built for the next rank")


def _case(cp_size, case_id):
    mix, causal, (nq, nkv), dtype, tail = CASES[case_id]
    thd = make_thd(LENGTH_MIXES[mix](2 * cp_size), cp_size, tail=tail * 2 * cp_size)
    return thd, causal, random_case(thd, nq, nkv, 8, dtype, seed=100 * cp_size + case_id)


def _run(q, k, v, case, index, attend):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = attend(q, k, v)
    loss = (out * case["dout"][index]).sum() + (lse * case["dlse"][:, index]).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    return {"out": out.detach(), "lse": lse.detach(), "dq": dq, "dk": dk, "dv": dv}


def _wrong_sections(step, rank, causal):
    q_rows, kv_rows, tile_causal = _RIGHT_SECTIONS(step, rank, causal)
    return ("all", "front", False) if q_rows == "back" else (q_rows, kv_rows, tile_causal)


_RIGHT_SECTIONS = ring_module.tile_sections


def _front_door(shard, group, causal, comm="p2p"):
    def attend(q, k, v):
        return thd_attention(q, k, v, shard, causal=causal, cp_group=group, return_lse=True, cp_comm_type=comm)

    return attend


def _one_rank_ring(shard, group, causal):
    """The degenerate ring (one diagonal step, no communication), called directly."""
    meta = thd_meta(shard)

    def attend(q, k, v):
        return ring_module.ring_attention(q, k, v, meta, cp_group=group, causal=causal, scale=q.shape[-1] ** -0.5)

    return attend


def _cases_of_group(cp_size, group, case_ids):
    cp_rank = dist.get_rank(group)
    results = []
    for case_id in case_ids:
        thd, causal, case = _case(cp_size, case_id)
        shard, index = shard_of(thd, cp_size, cp_rank)
        q, k, v = (case[n][index] for n in ("q", "k", "v"))
        methods = {comm: _front_door(shard, group, causal, comm) for comm in ("p2p", "all_gather")}
        if cp_size == 1:
            methods["ring of one"] = _one_rank_ring(shard, group, causal)
        for method, attend in methods.items():
            results.append(((cp_size, case_id, method), index, _run(q, k, v, case, index, attend)))
    return results


def _mutants_of_group(cp_size, group):
    cp_rank = dist.get_rank(group)
    thd, causal, case = _case(cp_size, 2)
    shard, index = shard_of(thd, cp_size, cp_rank)
    attend = _front_door(shard, group, causal)
    q, k, v = (case[n][index] for n in ("q", "k", "v"))
    ring_module.tile_sections = _wrong_sections
    try:
        wrong_tile = _run(q, k, v, case, index, attend)
    finally:
        ring_module.tile_sections = _RIGHT_SECTIONS
    _, next_index = shard_of(thd, cp_size, (cp_rank + 1) % cp_size)
    q, k, v = (case[n][next_index] for n in ("q", "k", "v"))
    wrong_shard = _run(q, k, v, case, next_index, attend)
    return [((cp_size, 2, MUTANTS[0]), index, wrong_tile), ((cp_size, 2, MUTANTS[1]), index, wrong_shard)]


def _pipeline_batch(cp_size):
    """Two packs of 48 tokens through thdpack.thd_collate: the global THD batch the trainer gets."""
    m = 2 * cp_size
    packs = []
    for lengths in ([5, 17, 1], [30, 2]):
        slots = [-(-n // m) * m for n in lengths]
        slots[-1] += 48 - sum(slots)  # the pack's tail padding joins its last sequence
        tokens = [t for n, slot in zip(lengths, slots, strict=True) for t in [7] * n + [0] * (slot - n)]
        positions = [p for slot in slots for p in range(slot)]
        labels = [t if t else -100 for t in tokens]
        packs.append(
            {
                "input_ids": tokens,
                "labels": labels,
                "position_ids": positions,
                "seq_lens": lengths,
                "seq_lens_padded": slots,
            }
        )
    thd = thd_collate(packs)
    case = random_case(thd, 4, 2, 8, torch.float64, seed=cp_size)
    assert torch.equal(case["valid"], ~thd["padding_mask"])
    return thd, case


def _pipeline_of_group(cp_size, group):
    """thd_collate -> cp.shard (which re-indexes q/k/v like any per-token tensor) -> thd_attention."""
    thd, case = _pipeline_batch(cp_size)
    shard_batch = shard({**thd, "q": case["q"], "k": case["k"], "v": case["v"]}, cp_size, dist.get_rank(group))
    _, index = shard_of(thd, cp_size, dist.get_rank(group))
    assert torch.equal(shard_batch["q"], case["q"][index])
    results = []
    for comm in ("p2p", "all_gather"):
        attend = _front_door(shard_batch, group, True, comm)
        got = _run(shard_batch["q"], shard_batch["k"], shard_batch["v"], case, index, attend)
        results.append(((cp_size, "pipeline", comm), index, got))
    return results


def _rank_main(rank, world_size):
    """Every (cp_size, case, method) this rank's groups run: [(key, global index, results)]."""
    torch.set_num_threads(1)
    singles = [dist.new_group([r]) for r in range(world_size)]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    results = []
    if rank == 0:
        results += _cases_of_group(1, singles[0], range(len(CASES)))
    # the two pairs split the cases between them
    results += _cases_of_group(2, pairs[rank // 2], range(rank // 2, len(CASES), 2))
    results += _mutants_of_group(2, pairs[rank // 2])
    results += _pipeline_of_group(2, pairs[rank // 2])
    results += _cases_of_group(4, dist.group.WORLD, range(len(CASES)))
    results += _mutants_of_group(4, dist.group.WORLD)
    results += _pipeline_of_group(4, dist.group.WORLD)
    return results


@pytest.fixture(scope="module")
def cp_runs():
    """{(cp_size, case_id, method): [(index, results) per rank]} from one 4-rank launch."""
    runs: dict = {}
    for rank_results in run_distributed(_rank_main, 4):
        for key, index, got in rank_results:
            runs.setdefault(key, []).append((index, got))
    return runs


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_cp_attention_matches_reference(cp_runs, cp_size):
    checked = 0
    for case_id, (mix, causal, _, dtype, _) in enumerate(CASES):
        thd, causal, case = _case(cp_size, case_id)
        want = reference_results(case, thd, causal)
        methods = ("p2p", "all_gather", "ring of one") if cp_size == 1 else ("p2p", "all_gather")
        for method in methods:
            shards = cp_runs[(cp_size, case_id, method)]
            assert sorted(torch.cat([i for i, _ in shards]).tolist()) == list(range(len(case["valid"])))
            worst = worst_errors(shards, want, case["valid"])
            assert max(worst.values()) <= TOL[dtype], (cp_size, mix, causal, method, worst)
            checked += 1
    assert checked == len(CASES) * len(methods)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_ring_and_all_gather_agree(cp_runs, cp_size):
    for case_id, (*_, dtype, _) in enumerate(CASES):
        ring = dict((tuple(i.tolist()), g) for i, g in cp_runs[(cp_size, case_id, "p2p")])
        gather = dict((tuple(i.tolist()), g) for i, g in cp_runs[(cp_size, case_id, "all_gather")])
        assert ring.keys() == gather.keys()
        for index, got in ring.items():
            for name, value in got.items():
                assert torch.allclose(value, gather[index][name], atol=TOL[dtype], rtol=0), (case_id, name)


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("mutant", MUTANTS)
def test_the_comparison_detects_a_broken_layout(cp_runs, cp_size, mutant):
    thd, causal, case = _case(cp_size, 2)
    worst = worst_errors(cp_runs[(cp_size, 2, mutant)], reference_results(case, thd, causal), case["valid"])
    assert max(worst.values()) > 1e-3, worst


@pytest.mark.parametrize("cp_size", [2, 4])
def test_the_thd_pipeline_feeds_cp_attention(cp_runs, cp_size):
    thd, case = _pipeline_batch(cp_size)
    want = reference_results(case, thd, True)
    for comm in ("p2p", "all_gather"):
        worst = worst_errors(cp_runs[(cp_size, "pipeline", comm)], want, case["valid"])
        assert max(worst.values()) <= 1e-10, (comm, worst)
