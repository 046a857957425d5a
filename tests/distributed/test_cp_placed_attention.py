"""Attention under a per-sequence CP placement in real processes (gloo), against the oracle.

One launch of 4 ranks covers cp 2 (both pairs, side by side), cp 3 (ranks 0-2) and cp 4 (all):
every rank builds the same global batch of packs that mix whole, subgroup-split (cp 4: over a
pair of ranks) and all-split sequences with empty and non-empty padding entries
(``support.placement_cases.MIXED_PACKS``), shards it by its placement, runs ``thd_attention(...,
cp_group=topology)`` (a plain process group for cp 3, whose placements split over all three ranks
only) forward and backward with every backend the CPU has (``math`` with the ring and
the all-gather, ``sdpa`` without an LSE, ``flex`` forward only: no CPU backward), and returns its
shard's results; the parent compares them with the per-sequence dense fp64 oracle on the real
tokens. Two deliberately wrong layouts must fail the comparison, and a pack with no split
sequence must call no collective at all.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import thdpack.cp.comm as comm
from thdpack.attention import thd_attention
from thdpack.cp import shard
from thdpack.cp.topology import CpTopology
from thdpack.testing import run_distributed
from thdpack.thd.parts import shard_parts

from support.attention_cases import random_case, reference_results, worst_errors
from support.placement_cases import MIXED_PACKS, WHOLE_PACKS, placed_metadata, shard_rows

pytestmark = pytest.mark.distributed

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
# (backend, cp_comm_type, causal, dtype, gradients): every path the CPU runs
METHODS = [
    ("math", "p2p", True, torch.float64, True),
    ("math", "all_gather", True, torch.float64, True),
    ("math", "p2p", False, torch.float64, True),
    ("math", "all_gather", False, torch.float64, True),
    ("math", "p2p", True, torch.float32, True),
    ("sdpa", "p2p", True, torch.float64, True),
    ("sdpa", "all_gather", False, torch.float64, True),
    ("flex", "p2p", True, torch.float64, False),
    # the all-to-all gathers whole sequences from the placed shard: the backend's kernel, no parts
    ("math", "a2a", True, torch.float64, True),
    ("sdpa", "a2a", False, torch.float64, True),
    ("flex", "a2a", True, torch.float64, False),
]
HEADS = 4
"""Query heads of the cases; the all-to-all needs cp to divide them (cp 3 runs no a2a method)."""


def _runs_at(method: tuple, cp_size: int) -> bool:
    return method[1] != "a2a" or HEADS % cp_size == 0


MUTANTS = ("mutant: the next rank's rows", "mutant: whole part first")


def _case(cp_size: int, dtype: torch.dtype, seed: int) -> tuple[dict, dict]:
    thd = placed_metadata(MIXED_PACKS[cp_size])
    return thd, random_case(thd, HEADS, 2, 8, dtype, seed=seed)


def _run(local: dict, cp, q, k, v, case: dict, index, method) -> dict:
    backend, comm_type, causal, _, gradients = method
    with_lse = backend != "sdpa"
    q, k, v = (t.clone().requires_grad_(gradients) for t in (q, k, v))
    with torch.set_grad_enabled(gradients):
        result = thd_attention(
            q, k, v, local, cp_group=cp, backend=backend, cp_comm_type=comm_type, causal=causal,
            return_lse=with_lse,
        )  # fmt: skip
    out, lse = result if with_lse else (result, None)
    got = {"out": out.detach()}
    if with_lse:
        got["lse"] = lse.detach()
    if gradients:
        loss = (out * case["dout"][index].to(out.dtype)).sum()
        if with_lse:
            loss = loss + (lse * case["dlse"][:, index].to(lse.dtype)).sum()
        got.update(zip(("dq", "dk", "dv"), torch.autograd.grad(loss, (q, k, v)), strict=True))
    return got


def _cp_rank(cp) -> int:
    return cp.cp_rank if isinstance(cp, CpTopology) else dist.get_rank(cp)


def _methods_in(cp, cp_size: int) -> list:
    rank = _cp_rank(cp)
    results = []
    for m, method in enumerate(METHODS):
        if not _runs_at(method, cp_size):
            continue
        thd, case = _case(cp_size, method[3], seed=10 * cp_size + m)
        local = shard(thd, cp_size, rank)
        index = shard_rows(local)
        q, k, v = (case[n][index] for n in ("q", "k", "v"))
        results.append(((cp_size, m), index, _run(local, cp, q, k, v, case, index, method)))
    return results


def _mutants_in(cp, cp_size: int) -> list:
    """Two wrong layouts under the right record: the next rank's rows, and the parts' rows swapped
    (the whole sequences where the split chunks should be)."""
    rank = _cp_rank(cp)
    method = METHODS[0]
    thd, case = _case(cp_size, torch.float64, seed=10 * cp_size)
    local = shard(thd, cp_size, rank)
    index = shard_rows(local)
    foreign = shard_rows(shard(thd, cp_size, (rank + 1) % cp_size))
    parts = shard_parts(local["thd_meta"])
    swapped = torch.cat([index[p.rows] for p in reversed(parts)])
    out = []
    for name, rows in zip(MUTANTS, (foreign, swapped), strict=True):
        q, k, v = (case[n][rows] for n in ("q", "k", "v"))
        out.append(((cp_size, name), index, _run(local, cp, q, k, v, case, index, method)))
    return out


class _Counted:
    """Records every call to a torch.distributed entry point thdpack's CP attention could reach, as
    ``(name, size of the group it ran on, rows it moved)`` (the ring's point-to-point operations go
    through ``batch_isend_irecv``; the all-gather's through cp.comm's two row collectives)."""

    NAMES = ("batch_isend_irecv", "send", "recv", "all_reduce", "all_gather", "broadcast", "barrier", "new_group",
             "all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor")  # fmt: skip

    def __init__(self):
        self.calls: list[tuple] = []
        self._saved = {}

    @staticmethod
    def _facts(name, args, kwargs):
        if name == "batch_isend_irecv":
            return dist.get_world_size(args[0][0].group), args[0][0].tensor.shape[0]
        if name in ("_all_gather", "_reduce_scatter"):
            rows = args[1].shape[0] if name == "_all_gather" else args[0].shape[0]
            return dist.get_world_size(kwargs["group"]), rows
        return None, None

    def _wrap(self, owner, name):
        original = getattr(owner, name)
        self._saved[(owner, name)] = original

        def counted(*args, **kwargs):
            self.calls.append((name, *self._facts(name, args, kwargs)))
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    def __enter__(self):
        for name in self.NAMES:
            if hasattr(dist, name):
                self._wrap(dist, name)
        self._wrap(comm, "_all_gather")  # captured at import
        self._wrap(comm, "_reduce_scatter")
        return self

    def __exit__(self, *exc):
        for (owner, name), original in self._saved.items():
            setattr(owner, name, original)


def _collectives_in(topology: CpTopology) -> dict:
    """Collective calls of a forward and backward per comm type: none for a pack of whole
    sequences; some for the mixed packs (the counter sees them)."""
    cp_size, rank = topology.cp_size, topology.cp_rank
    counts = {}
    for label, packs in (("whole", WHOLE_PACKS[cp_size]), ("mixed", MIXED_PACKS[cp_size])):
        thd = placed_metadata(packs)
        case = random_case(thd, 4, 2, 8, torch.float64, seed=1)
        local = shard(thd, cp_size, rank)
        index = shard_rows(local)
        for comm_type in ("p2p", "all_gather"):
            q, k, v = (case[n][index] for n in ("q", "k", "v"))
            with _Counted() as counter:
                got = _run(local, topology, q, k, v, case, index, ("math", comm_type, True, torch.float64, True))
            counts[(label, comm_type)] = (list(counter.calls), index, got)
    return counts


def _rank_main(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    pairs = CpTopology.create(2, device_type="cpu")  # dp 2 x cp 2: both pairs side by side
    triple = dist.new_group([0, 1, 2])
    cp4 = CpTopology.create(4, device_type="cpu")  # with its placement groups, the pairs
    out: dict = {"results": [], "collectives": {}}
    out["collectives"][4] = _collectives_in(cp4)
    out["collectives"][2] = _collectives_in(pairs)
    out["results"] += _methods_in(pairs, 2)
    out["results"] += _mutants_in(pairs, 2)
    if rank < 3:
        out["results"] += _methods_in(triple, 3)
        out["results"] += _mutants_in(triple, 3)
    out["results"] += _methods_in(cp4, 4)
    out["results"] += _mutants_in(cp4, 4)
    return out


@pytest.fixture(scope="module")
def placed_runs():
    """{(cp_size, method index or mutant): [(index, results) per rank]}, and the collective counts."""
    runs: dict = {}
    collectives = []
    for rank_out in run_distributed(_rank_main, 4):
        for key, index, got in rank_out["results"]:
            runs.setdefault(key, []).append((index, got))
        collectives.append(rank_out["collectives"])
    return runs, collectives


@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_placed_cp_attention_matches_the_reference(placed_runs, cp_size):
    runs, _ = placed_runs
    ranks = 3 if cp_size == 3 else 4  # cp 2 runs on both pairs: each of its ranks twice over
    for m, (backend, comm_type, causal, dtype, gradients) in enumerate(METHODS):
        if not _runs_at(METHODS[m], cp_size):
            continue
        thd, case = _case(cp_size, dtype, seed=10 * cp_size + m)
        want = reference_results(case, thd, causal, with_dlse=backend != "sdpa")
        shards = runs[(cp_size, m)]
        assert len(shards) == ranks
        assert sorted(torch.cat([i for i, _ in shards]).tolist()) == sorted(
            list(range(len(case["valid"]))) * (ranks // cp_size)
        )
        worst = worst_errors(shards, want, case["valid"])
        assert set(worst) == {"out", "lse", "dq", "dk", "dv"} - ({"lse"} if backend == "sdpa" else set()) - (
            set() if gradients else {"dq", "dk", "dv"}
        )
        tolerance = {**{k: TOL[dtype] for k in worst}, **({"lse": 1e-6} if backend == "flex" else {})}
        assert all(worst[k] <= tolerance[k] for k in worst), (cp_size, backend, comm_type, causal, dtype, worst)


@pytest.mark.parametrize("cp_size", [2, 3, 4])
@pytest.mark.parametrize("mutant", MUTANTS)
def test_the_comparison_detects_a_wrong_layout(placed_runs, cp_size, mutant):
    runs, _ = placed_runs
    thd, case = _case(cp_size, torch.float64, seed=10 * cp_size)
    worst = worst_errors(runs[(cp_size, mutant)], reference_results(case, thd, True), case["valid"])
    assert max(worst.values()) > 1e-3, worst


@pytest.mark.parametrize("cp_size", [2, 4])
def test_a_pack_without_split_sequences_communicates_nothing(placed_runs, cp_size):
    _, collectives = placed_runs
    for rank_counts in collectives:
        for comm_type in ("p2p", "all_gather"):
            calls, _, _ = rank_counts[cp_size][("whole", comm_type)]
            assert calls == [], (comm_type, calls)
            mixed, _, _ = rank_counts[cp_size][("mixed", comm_type)]
            assert mixed, "the counter sees the mixed packs' collectives"
    # and the results of the counted runs are exact too
    for label, packs in (("whole", WHOLE_PACKS[cp_size]), ("mixed", MIXED_PACKS[cp_size])):
        thd = placed_metadata(packs)
        case = random_case(thd, 4, 2, 8, torch.float64, seed=1)
        want = reference_results(case, thd, True)
        for comm_type in ("p2p", "all_gather"):
            shards = [(index, got) for counts in collectives for _, index, got in [counts[cp_size][(label, comm_type)]]]
            worst = worst_errors(shards, want, case["valid"])
            assert max(worst.values()) <= 1e-10, (label, comm_type, worst)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_only_the_split_sequences_k_v_travel_within_their_groups(placed_runs, cp_size):
    """Every exchange of a forward and backward moves exactly the rows of one split group's part, over
    that group's process group: the ring (g - 1 K/V hops forward; g - 1 K/V and g dK/dV hops
    backward) and the all-gather (K and V gathered, dK and dV reduce-scattered) of each group."""
    _, collectives = placed_runs
    thd = placed_metadata(MIXED_PACKS[cp_size])
    for rank, rank_counts in enumerate(collectives):
        local = shard(thd, cp_size, rank % cp_size)
        parts = [(p.group_size, p.rows.stop - p.rows.start) for p in shard_parts(local["thd_meta"]) if p.group_size > 1]
        ring = sorted(("batch_isend_irecv", g, n) for g, n in parts for _ in range(3 * g - 2))
        gather = sorted((name, g, n) for g, n in parts for name in ("_all_gather",) * 2 + ("_reduce_scatter",) * 2)
        calls = {comm_type: rank_counts[cp_size][("mixed", comm_type)][0] for comm_type in ("p2p", "all_gather")}
        # the topology made every group before: attention creates none
        assert sorted(calls["p2p"]) == ring, rank
        assert sorted(calls["all_gather"]) == gather, rank
