"""The trainer's own step (DDP over dp x cp, StepLoss, cp.shard, balanced dealing) equals the
same global batch run unpacked on one process: loss and every gradient, fp64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from thdpack.testing import run_distributed

pytestmark = pytest.mark.distributed
VOCAB = 97


def _samples() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    lengths = [1, 4, 9, 31, 2, 17, 8, 60, 6, 3, 11, 5, 7, 40, 23, 12, 33, 8]
    return [{"input_ids": rng.integers(0, VOCAB, n)} for n in lengths]


def _config(cp_size: int, reduction: str, sharding: str):
    from thdpack.train.config import AttentionNode, Config, ModelNode, PackingNode, ParallelConfig, TrainConfig

    return Config(
        model=ModelNode(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32),
        attention=AttentionNode(backend="math"),
        packing=PackingNode(pack_size=64, overflow="split"),
        parallel=ParallelConfig(cp_size=cp_size, dp_sharding=sharding),
        train=TrainConfig(precision="fp64", micro_batches=2, loss_reduction=reduction),
    )


def _pieces(packs) -> list[dict[str, torch.Tensor]]:
    """Every sequence of the packs as its own sample (input_ids and labels as packed)."""
    out = []
    for pack in packs:
        start = 0
        for real, slot in zip(pack["seq_lens"].tolist(), pack["seq_lens_padded"].tolist(), strict=True):
            out.append({k: pack[k][start : start + real].clone() for k in ("input_ids", "labels")})
            start += slot
    return out


def _step_vs_unpacked(rank: int, world: int, cp_size: int, reduction: str, sharding: str) -> dict[str, float]:
    from thdpack.models.transformer import Transformer
    from thdpack.packing.dataset import PackedDataset
    from thdpack.train.config import ParallelConfig
    from thdpack.train.forward_backward import forward_backward
    from thdpack.train.model_setup import build_model
    from thdpack.train.runtime import init_runtime
    from thdpack.train.trainer import shard_micro_batches
    from thdpack.verify.exactness import unpacked_step

    cfg = _config(cp_size, reduction, sharding)
    runtime = init_runtime(ParallelConfig(cp_size=cp_size, dp_sharding=sharding), cp_placement="te")
    samples = _samples()

    def dataset(**dealing) -> PackedDataset:
        return PackedDataset(samples, cfg.packing.pack_size, cp_size=cp_size, overflow="split", seed=3, **dealing)

    topology = runtime.topology
    stream = dataset(dp_rank=topology.dp_rank, dp_size=topology.dp_size).step_stream(
        micro_batches=2, packs_per_micro_batch=1
    )
    model, inner = build_model(cfg, runtime, VOCAB)
    micro = shard_micro_batches(stream.next_step().micro_batches, runtime, reduction=reduction)
    loss = float(forward_backward(model, micro, topology=topology).value())
    grads = {
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
        for name, p in inner.named_parameters()
    }

    # the same global step, every sequence alone on one process
    everything = dataset(balance="none").step_stream(micro_batches=2 * topology.dp_size, packs_per_micro_batch=1)
    packs = [p for mb in everything.next_step().micro_batches for p in mb]
    reference = Transformer(cfg.model_config(), seed=cfg.train.seed, dtype=torch.float64)
    want = unpacked_step(reference, _pieces(packs), reduction)
    diffs = {"loss": abs(loss - want.loss)}
    for name, grad in grads.items():
        diffs[name] = float((grad - want.grads[name]).abs().max())
    return diffs


@pytest.mark.parametrize(
    ("cp_size", "reduction", "sharding"),
    [(2, "token_mean", "ddp"), (1, "token_mean", "ddp"), (2, "sequence_mean", "ddp"), (2, "token_mean", "fsdp")],
    ids=["dp1xcp2", "dp2xcp1", "dp1xcp2-sequence-mean", "dp1xcp2-fsdp"],
)
def test_trainer_step_equals_unpacked(cp_size, reduction, sharding):
    for diffs in run_distributed(_step_vs_unpacked, 2, cp_size, reduction, sharding):
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] <= 1e-10, f"{worst}: {diffs[worst]:.3e}"
