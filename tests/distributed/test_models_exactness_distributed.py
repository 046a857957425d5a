"""Model-level exactness on real gloo ranks: the reference decoder's packed, CP-sharded,
DP-spread training step with 2 accumulation micro-steps equals every sequence alone.

One launch per world size (2, 3 and 4 ranks; dp 1 x cp 1 runs in the test process) hosts every
spread of that size, each through its own ``CpTopology``: dp x cp in {1x1, 2x1, 1x2, 2x2}, token
mean and per-sequence mean, fp64. Each rank packs the same random sequences (lengths 1 and
exactly 2*cp_size among them, tail padding), shards its micro-batches with ``cp.shard``, runs
``Transformer(shard, cp_group=topology)``, the global-denominator loss of ``thdpack.loss`` and the
gradient average over the flattened DP x CP group (ring CP; at dp 2 x cp 2 also all-gather and
all-to-all CP). The loss, every parameter gradient and every real token's logits must equal the
unpacked single-process oracle (``support.model_oracle``) to 1e-10; each planted layout bug must break
that. The same holds under a per-sequence CP placement (``cp_placement="adaptive"``: short
sequences whole on one rank, long ones split over a pair of ranks or all of them) at dp x cp in
{1x2, 1x3, 1x4, 2x2}, with the ring, the all-gather and the all-to-all.
"""

from __future__ import annotations

import pytest
import torch

from thdpack.cp.topology import CpTopology
from thdpack.models import ModelConfig, Transformer
from thdpack.testing import run_distributed
from thdpack.verify.exactness import (
    StepSpread,
    global_micro_batches,
    make_samples,
    pack_size_for,
    packed_step,
    sample_lengths,
)

from support.model_oracle import compare, oracle_step

pytestmark = pytest.mark.distributed

CONFIG = ModelConfig.preset("tiny")
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
REDUCTIONS = ["token_mean", "sequence_mean"]
# (dp, cp, fault, the quantity it must break)
FAULT_CASES = [
    (1, 2, "local_positions", "logits"),
    (1, 2, "foreign_shard", "logits"),
    (2, 2, "cross_sequence_attention", "logits"),
    (2, 2, "mean_of_means", "grads"),
]
# (dp, cp, cp_comm_type) under cp_placement="adaptive"
ADAPTIVE = [(1, 2, "p2p"), (1, 3, "p2p"), (1, 4, "p2p"), (2, 2, "p2p"), (1, 4, "all_gather"), (1, 4, "a2a")]
ADAPTIVE_FAULTS = [(1, 4, "local_positions", "logits"), (1, 4, "foreign_shard", "logits")]
TOL = 1e-10


def _samples():
    return make_samples(sample_lengths(StepSpread()), CONFIG.vocab_size, seed=0)


def _model(cp_comm_type: str = "p2p") -> Transformer:
    return Transformer(ModelConfig.preset("tiny", cp_comm_type=cp_comm_type), seed=1, dtype=torch.float64)


def _cases() -> list[tuple]:
    """``(result key, spread, cp_comm_type)`` of every packed step the tests compare."""
    cases = [
        ((dp, cp, reduction, "none"), StepSpread(dp_size=dp, cp_size=cp, reduction=reduction), "p2p")
        for dp, cp in LAYOUTS
        for reduction in REDUCTIONS
    ]
    cases += [
        ((dp, cp, "token_mean", f), StepSpread(dp_size=dp, cp_size=cp, fault=f), "p2p") for dp, cp, f, _ in FAULT_CASES
    ]
    cases += [(comm, StepSpread(dp_size=2, cp_size=2), comm) for comm in ("all_gather", "a2a")]  # Llama 3's, Ulysses
    adaptive = [(dp, cp, comm, "none") for dp, cp, comm in ADAPTIVE]
    adaptive += [(dp, cp, "p2p", fault) for dp, cp, fault, _ in ADAPTIVE_FAULTS]
    for dp, cp, comm, fault in adaptive:
        spread = StepSpread(dp_size=dp, cp_size=cp, fault=fault, cp_placement="adaptive")
        cases.append((("adaptive", dp, cp, comm, fault), spread, comm))
    return cases


def world_cases(rank: int, world: int) -> dict:
    """Every case of ``world`` ranks; each dp x cp layout through its own ``CpTopology`` (two of
    them in one process at world 2 and 4), made in the same order on every rank."""
    samples = _samples()
    assert sample_lengths(StepSpread(dp_size=2, cp_size=2)) == sample_lengths(StepSpread()), "one batch for all"
    topologies: dict = {}
    results: dict = {}
    for key, spread, comm in _cases():
        if spread.world_size != world:
            continue
        layout = spread.dp_size, spread.cp_size
        if layout not in topologies:
            topologies[layout] = (
                CpTopology.create(spread.cp_size, device_type="cpu") if world > 1 else CpTopology.single()
            )
        topology = topologies[layout]
        pack_size = pack_size_for(sample_lengths(spread), spread.cp_size, spread.cp_placement)
        batches = global_micro_batches(samples, spread, pack_size)
        results[key] = packed_step(_model(comm), batches[topology.dp_rank], spread, topology)
    return results


@pytest.fixture(scope="module")
def rank_results() -> list[dict]:
    """Per rank, every case it took part in: dp 1 x cp 1 in this process, then one launch per world size."""
    results = [world_cases(0, 1), {}, {}, {}]
    for world in (2, 3, 4):
        for rank, got in enumerate(run_distributed(world_cases, world)):
            results[rank].update(got)
    return results


@pytest.fixture(scope="module")
def oracles() -> dict:
    return {reduction: oracle_step(_model(), _samples(), reduction) for reduction in REDUCTIONS}


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(("dp_size", "cp_size"), LAYOUTS)
def test_packed_sharded_accumulated_step_equals_unpacked(rank_results, oracles, dp_size, cp_size, reduction):
    ranks = [rank_results[r][dp_size, cp_size, reduction, "none"] for r in range(dp_size * cp_size)]
    errors = compare(ranks, oracles[reduction])
    assert max(errors.values()) <= TOL, f"dp {dp_size} x cp {cp_size}, {reduction}: {errors}"


@pytest.mark.parametrize("cp_comm_type", ["all_gather", "a2a"])
def test_the_other_cp_comm_types_are_exact_too(rank_results, oracles, cp_comm_type):
    errors = compare([rank_results[r][cp_comm_type] for r in range(4)], oracles["token_mean"])
    assert max(errors.values()) <= TOL, errors


@pytest.mark.parametrize(("dp_size", "cp_size", "fault", "quantity"), FAULT_CASES)
def test_a_wrong_layout_fails_the_comparison(rank_results, oracles, dp_size, cp_size, fault, quantity):
    ranks = [rank_results[r][dp_size, cp_size, "token_mean", fault] for r in range(dp_size * cp_size)]
    errors = compare(ranks, oracles["token_mean"])
    assert errors[quantity] > 1e-4, f"{fault} went unnoticed: {errors}"


@pytest.mark.parametrize(("dp_size", "cp_size", "cp_comm_type"), ADAPTIVE)
def test_adaptive_placement_step_equals_unpacked(rank_results, oracles, dp_size, cp_size, cp_comm_type):
    ranks = [rank_results[r]["adaptive", dp_size, cp_size, cp_comm_type, "none"] for r in range(dp_size * cp_size)]
    errors = compare(ranks, oracles["token_mean"])
    assert max(errors.values()) <= TOL, f"adaptive dp {dp_size} x cp {cp_size} ({cp_comm_type}): {errors}"


@pytest.mark.parametrize(("dp_size", "cp_size", "fault", "quantity"), ADAPTIVE_FAULTS)
def test_a_wrong_adaptive_layout_fails_the_comparison(rank_results, oracles, dp_size, cp_size, fault, quantity):
    ranks = [rank_results[r]["adaptive", dp_size, cp_size, "p2p", fault] for r in range(dp_size * cp_size)]
    errors = compare(ranks, oracles["token_mean"])
    assert errors[quantity] > 1e-4, f"{fault} went unnoticed under the adaptive placement: {errors}"


def test_the_adaptive_packs_mix_whole_pair_split_and_all_split_sequences():
    spread = StepSpread(cp_size=4, cp_placement="adaptive")
    batches = global_micro_batches(_samples(), spread, pack_size_for(sample_lengths(spread), 4, "adaptive"))
    metas = [thd["thd_meta"] for thd in batches[0]]
    sizes = {int(g) for meta in metas for g, n in zip(meta.groups.size_S, meta.lengths, strict=True) if n}
    assert sizes == {1, 2, 4}
