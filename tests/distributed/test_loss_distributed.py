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


def config_step(rank: int, dp_size: int, cp_size: int, groups: dict) -> dict:
    """One optimizer step of the (dp_size, cp_size) layout, on ranks 0 .. dp_size*cp_size-1."""
    world = dp_size * cp_size
    dp_rank, cp_rank = divmod(rank, cp_size)
    dp_cp_group, cp_group, dp_group = groups["dp_cp"], groups["cp"][dp_rank], groups["dp"][cp_rank]
    shards = local_shards(dp_size, dp_rank, cp_size, cp_rank)
    out = {}
    for reduction in ("token_mean", "sequence_mean"):
        for layout in ("flat_average", "dp_average_cp_sum"):
            model = make_model()
            per_sequence = reduction == "sequence_mean"  # token mean: counted from the labels alone
            loss = StepLoss.begin(
                [mb["labels"] for mb in shards],
                micro_batch_weights=[mb["weights"] for mb in shards] if per_sequence else None,
                grad_average_size=world if layout == "flat_average" else dp_size,
                group=dp_cp_group,
            )
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


def all_layouts(rank: int, world: int) -> dict:
    """Every layout in one launch: layout (dp, cp) runs on the first dp*cp ranks, through its own
    process groups (as a trainer's DP x CP group is a subgroup of the world)."""
    results = {}
    for dp_size, cp_size in LAYOUTS:
        # every rank creates every group, in the same order, members or not
        groups = {
            "dp_cp": dist.new_group(list(range(dp_size * cp_size))),
            "cp": [dist.new_group(list(range(d * cp_size, (d + 1) * cp_size))) for d in range(dp_size)],
            "dp": [dist.new_group(list(range(c, dp_size * cp_size, cp_size))) for c in range(cp_size)],
        }
        if rank < dp_size * cp_size:
            results[dp_size, cp_size] = config_step(rank, dp_size, cp_size, groups)
    return results


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
    return run_distributed(all_layouts, 4)


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
