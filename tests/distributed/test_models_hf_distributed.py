"""Real transformers models with context parallelism on gloo ranks: Llama, Qwen2, Mistral and
Gemma (tiny random configs, fp64) on thdpack's registered attention, one packed row sharded with
``cp.shard`` over CP 2 and 4. transformers' own loss on each rank's shard (``num_items_in_batch`` =
the global loss-token count), loss and gradients summed over the CP group: the loss and every
parameter gradient must equal each sequence run alone through plain eager transformers, to 1e-10.

One 4-rank launch hosts both CP sizes (a dp 2 x cp 2 and a cp 4 ``CpTopology``), every
architecture inside the ranks (starting processes and importing transformers is the cost on a
2-core machine). Each CP size also plants a bug (the shard's positions left out, so transformers
counts 0..T_local-1 on every rank and RoPE is wrong) that the comparison must catch, and asks
``hf_packed_kwargs`` for HF's own sdpa on a shard, which must be refused; Llama also runs with
all-to-all CP (``cp_comm_type="a2a"``). The adapter passes a per-sequence CP placement through
unchanged: Llama and Qwen2 on a row whose sequences are whole on one rank, split over a pair of
ranks (cp 4) or over all of them are exact too.
"""

from __future__ import annotations

import pytest

from thdpack.attention.config import AttentionConfig
from thdpack.cp.topology import CpTopology
from thdpack.models.hf.attention import register_hf_attention
from thdpack.testing import run_distributed

from support.hf_cases import (
    ARCHITECTURES,
    differences,
    hf_model,
    packed_row,
    packed_step,
    placed_row,
    samples,
    unpacked_step,
)

pytestmark = pytest.mark.distributed

CP_SIZES = [2, 4]
PLACED_ARCHITECTURES = ["Llama", "Qwen2"]
TOL = 1e-10


def cp_steps(rank: int, world: int) -> dict:
    """This rank's results per CP size (CP 2 on ranks {0, 1} and {2, 3}, CP 4 on all four): per
    architecture the summed loss and gradients, the planted bug's, and the refusal message for
    sdpa on a shard."""
    name = register_hf_attention()
    # every rank makes both, in order: dp 2 x cp 2 (the pairs), and cp 4 with its pairs' placement groups
    topologies = {cp_size: CpTopology.create(cp_size, device_type="cpu") for cp_size in (2, 4)}
    results: dict = {}
    for cp_size, topology in topologies.items():
        thd = packed_row(samples(), cp_size=cp_size)
        out: dict = {}
        for arch in ARCHITECTURES:
            out[arch] = packed_step(hf_model(arch, name), thd, topology=topology)
        out["Llama a2a"] = packed_step(
            hf_model("Llama", name), thd, topology=topology, attention=AttentionConfig(cp_comm_type="a2a")
        )
        out["no positions"] = packed_step(hf_model("Llama", name), thd, topology=topology, drop_position_ids=True)
        try:
            packed_step(hf_model("Llama", "sdpa"), thd, topology=topology)
        except ValueError as err:
            out["sdpa"] = str(err)
        placed = placed_row(samples(), cp_size)
        for arch in PLACED_ARCHITECTURES:
            model = hf_model(arch, name)
            out["placed", arch] = packed_step(model, placed, topology=topology)
        results[cp_size] = out
    return results


@pytest.fixture(scope="module")
def references() -> dict:
    return {arch: unpacked_step(hf_model(arch, "eager"), samples()) for arch in ARCHITECTURES}


@pytest.fixture(scope="module")
def rank_results() -> list[dict]:
    return run_distributed(cp_steps, 4)


@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_cp_loss_and_every_gradient_equal_unpacked(rank_results, references, cp_size):
    for arch in ARCHITECTURES:
        for rank, result in enumerate(rank_results):
            errors = differences(result[cp_size][arch], references[arch])
            assert max(errors.values()) <= TOL, f"{arch}, cp {cp_size}, rank {rank}: {errors}"


@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_all_to_all_cp_is_exact_under_transformers(rank_results, references, cp_size):
    """``cp_comm_type="a2a"`` through the attention-config keyword (4 query / 2 KV heads: at cp 4
    each KV head travels twice)."""
    for rank, result in enumerate(rank_results):
        errors = differences(result[cp_size]["Llama a2a"], references["Llama"])
        assert max(errors.values()) <= TOL, f"cp {cp_size}, rank {rank}: {errors}"


@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_the_comparison_catches_positions_left_out(rank_results, references, cp_size):
    errors = differences(rank_results[0][cp_size]["no positions"], references["Llama"])
    assert errors["grads"] > 1e-6, f"cp {cp_size}: RoPE from local positions went unnoticed: {errors}"


@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_hugging_face_attention_is_refused_on_a_shard(rank_results, cp_size):
    for result in rank_results:
        assert "the model's attention 'sdpa' cannot run a CP shard" in result[cp_size].get("sdpa", "no error")


@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_an_adaptive_placement_passes_through_the_adapter(rank_results, references, cp_size):
    for arch in PLACED_ARCHITECTURES:
        for rank, result in enumerate(rank_results):
            errors = differences(result[cp_size]["placed", arch], references[arch])
            assert max(errors.values()) <= TOL, f"{arch}, adaptive cp {cp_size}, rank {rank}: {errors}"
