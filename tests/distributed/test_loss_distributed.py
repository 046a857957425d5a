"""Global loss normalisation on real gloo ranks: dp x cp with 2 accumulation micro-steps.

One global batch of sequences (with masked prompts) is spread over DP ranks and 2 micro-steps,
each micro-batch packed into THD with CP padding and sharded over CP ranks with TE's partition.
An embedding + linear head (fp64) trains on it. The loss and every parameter gradient must
equal the single-process unpacked computation to 1e-10, under both gradient-reduction layouts
(FSDP-style average over the flat dp x cp group; DDP average over DP plus a SUM over CP), and the
naive per-rank, per-micro-batch mean-of-means must visibly differ.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from thdpack.cp import partition_indices
from thdpack.cp.topology import CpTopology
from thdpack.loss import StepLoss, cross_entropy_sum, loss_weights
from thdpack.testing import run_distributed
from thdpack.thd.carriage import thd_meta

VOCAB, DIM, MICRO_STEPS = 13, 6, 2
LENGTHS = [3, 9, 2, 14, 5, 7, 1, 11, 4, 6]
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (dp_size, cp_size)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, DIM, dtype=torch.float64), torch.nn.Linear(DIM, VOCAB, dtype=torch.float64)
    )


def make_sequences() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) per sequence; labels are shifted already, a random prompt prefix is -100."""
    gen = torch.Generator().manual_seed(1)
    sequences = []
    for n in LENGTHS:
        input_ids = torch.randint(1, VOCAB, (n,), generator=gen)
        labels = torch.randint(0, VOCAB, (n,), generator=gen)
        prompt = int(torch.randint(0, n, (1,), generator=gen))
        labels[:prompt] = -100
        sequences.append((input_ids, labels))
    return sequences


def micro_batch(dp_size: int, dp_rank: int, step: int, cp_size: int) -> dict[str, torch.Tensor]:
    """The global THD batch of (dp_rank, step): its sequences padded to multiples of 2*cp_size."""
    bins = dp_size * MICRO_STEPS
    mine = [s for i, s in enumerate(make_sequences()) if i % bins == dp_rank * MICRO_STEPS + step]
    multiple = 2 * cp_size if cp_size > 1 else 1
    ids, labels, cu = [], [], [0]
    for input_ids, seq_labels in mine:
        pad = -len(input_ids) % multiple
        ids.append(torch.cat([input_ids, torch.zeros(pad, dtype=torch.long)]))
        labels.append(torch.cat([seq_labels, torch.full((pad,), -100)]))
        cu.append(cu[-1] + len(input_ids) + pad)
    return {"input_ids": torch.cat(ids), "labels": torch.cat(labels), "cu_seqlens_padded": torch.tensor(cu)}


def local_shards(dp_size: int, dp_rank: int, cp_size: int, cp_rank: int) -> list[dict[str, torch.Tensor]]:
    """This rank's CP shard of each micro-batch; the per-sequence weights come from the global batch."""
    shards = []
    for step in range(MICRO_STEPS):
        batch = micro_batch(dp_size, dp_rank, step, cp_size)
        cu = batch["cu_seqlens_padded"]
        total = int(cu[-1])
        idx = torch.arange(total) if cp_size == 1 else partition_indices(cu, total, cp_size, cp_rank).long()
        shard = {"input_ids": batch["input_ids"][idx], "labels": batch["labels"][idx]}
        meta = thd_meta({"cu_seqlens": cu})
        shard["weights"] = loss_weights(batch["labels"], meta, reduction="sequence_mean")[idx]
        shards.append(shard)
    return shards


def config_step(topology: CpTopology) -> dict:
    """One optimizer step of the topology's dp x cp layout on this rank."""
    world, dp_size, cp_size = topology.world_size, topology.dp_size, topology.cp_size
    dp_cp_group, cp_group, dp_group = topology.dp_cp_group, topology.cp_group, topology.dp_group
    shards = local_shards(dp_size, topology.dp_rank, cp_size, topology.cp_rank)
    out = {}
    for reduction in ("token_mean", "sequence_mean"):
        for layout in ("flat_average", "dp_average_cp_sum"):
            model = make_model()
            per_sequence = reduction == "sequence_mean"  # token mean: counted from the labels alone
            loss = StepLoss.begin(
                [mb["labels"] for mb in shards],
                micro_batch_weights=[mb["weights"] for mb in shards] if per_sequence else None,
                topology=topology,  # G = every rank: the flattened mesh's average
            )
            if layout == "dp_average_cp_sum":  # the same denominator, your own G
                loss = StepLoss(loss.denominator, grad_average_size=dp_size, group=dp_cp_group)
            for mb in shards:
                loss(model(mb["input_ids"]), mb["labels"], mb["weights"] if per_sequence else None).backward()
            for p in model.parameters():
                if layout == "flat_average":  # FSDP / DDP over the flattened dp x cp mesh
                    dist.all_reduce(p.grad, group=dp_cp_group)
                    p.grad /= world
                else:  # CP gradients summed, then DDP's average over DP
                    dist.all_reduce(p.grad, group=cp_group)
                    dist.all_reduce(p.grad, group=dp_group)
                    p.grad /= dp_size
            out[reduction, layout] = (loss.value().item(), [p.grad for p in model.parameters()])
    # the pitfall: mean over this rank's micro-batch tokens, averaged over micro-steps and ranks
    model = make_model()
    naive_local = torch.zeros((), dtype=torch.float64)
    for mb in shards:
        micro_mean = cross_entropy_sum(model(mb["input_ids"]), mb["labels"]) / (mb["labels"] != -100).sum()
        (micro_mean / MICRO_STEPS).backward()
        naive_local += micro_mean.detach() / MICRO_STEPS
    dist.all_reduce(naive_local, group=dp_cp_group)
    for p in model.parameters():
        dist.all_reduce(p.grad, group=dp_cp_group)
        p.grad /= world
    out["naive"] = ((naive_local / world).item(), [p.grad for p in model.parameters()])
    return out


def world_layouts(rank: int, world: int) -> dict:
    """Every layout of ``world`` ranks (at world 2: dp 2 x cp 1 and dp 1 x cp 2, two topologies in
    one process), each through its own ``CpTopology``."""
    return {
        (dp_size, cp_size): config_step(CpTopology.create(cp_size, device_type="cpu"))
        for dp_size, cp_size in LAYOUTS
        if dp_size * cp_size == world
    }


def unpacked_reference(reduction: str) -> tuple[float, list[torch.Tensor]]:
    """Single process, every sequence alone, the mean over the whole global batch."""
    model = make_model()
    per_sequence = []
    for input_ids, labels in make_sequences():
        ce = torch.nn.functional.cross_entropy(model(input_ids), labels, ignore_index=-100, reduction="none")
        per_sequence.append((ce.sum(), (labels != -100).sum()))
    if reduction == "token_mean":
        loss = sum(s for s, _ in per_sequence) / sum(n for _, n in per_sequence)
    else:
        with_tokens = [s / n for s, n in per_sequence if n > 0]
        loss = sum(with_tokens) / len(with_tokens)
    loss.backward()
    return loss.item(), [p.grad for p in model.parameters()]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def layout_results() -> list[dict]:
    """Per rank, the results of every layout it took part in: one launch per world size."""
    results: list[dict] = [{} for _ in range(4)]
    for world in (1, 2, 4):
        for rank, got in enumerate(run_distributed(world_layouts, world)):
            results[rank].update(got)
    return results


@pytest.mark.distributed
@pytest.mark.parametrize(("dp_size", "cp_size"), LAYOUTS)
def test_packed_sharded_accumulated_loss_equals_unpacked(layout_results, dp_size, cp_size):
    references = {r: unpacked_reference(r) for r in ("token_mean", "sequence_mean")}
    for rank in range(dp_size * cp_size):
        out = layout_results[rank][dp_size, cp_size]
        for (reduction, layout), (loss, grads) in ((k, v) for k, v in out.items() if k != "naive"):
            ref_loss, ref_grads = references[reduction]
            where = f"rank {rank}, {reduction}, {layout}"
            assert abs(loss - ref_loss) <= 1e-10, f"{where}: loss {loss} != {ref_loss}"
            assert max_diff(grads, ref_grads) <= 1e-10, f"{where}: gradients differ"
        naive_loss, naive_grads = out["naive"]
        ref_loss, ref_grads = references["token_mean"]
        assert abs(naive_loss - ref_loss) > 1e-3, "the mean-of-means should differ: the test would not discriminate"
        assert max_diff(naive_grads, ref_grads) > 1e-4
