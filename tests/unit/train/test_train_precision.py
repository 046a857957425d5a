"""``train.precision``: fp32 master weights under bf16 compute."""

from __future__ import annotations

import pytest
import torch

from thdpack.models import ModelConfig, Transformer
from thdpack.packing.packer import pack_from_segments
from thdpack.thd import thd_collate, thd_to_device
from thdpack.train.config import TrainConfig
from thdpack.train.precision import Precision


def test_named_precisions_resolve_to_dtypes():
    assert Precision.named("fp32") == Precision("fp32", torch.float32, None)
    assert Precision.named("fp64") == Precision("fp64", torch.float64, None)
    assert Precision.named("bf16-mixed") == Precision("bf16-mixed", torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match=r"unknown precision 'bf16'.*fp32, bf16-mixed, fp64"):
        Precision.named("bf16")


def test_pure_bf16_loses_the_update_that_fp32_master_weights_keep():
    """Why there is no pure-bf16 mode: one AdamW step of lr 6e-4 on a norm gain of 1.0."""
    moved = {}
    for dtype in (torch.bfloat16, torch.float32):
        gain = torch.nn.Parameter(torch.ones(4, dtype=dtype))
        optimizer = torch.optim.AdamW([gain], lr=6e-4, weight_decay=0.0)
        gain.grad = torch.full_like(gain, 0.5)
        optimizer.step()
        moved[dtype] = bool((gain != 1).all())
    assert moved == {torch.bfloat16: False, torch.float32: True}


def test_bf16_mixed_autocast_computes_in_bf16_and_keeps_fp32_weights_and_grads():
    config = ModelConfig(vocab_size=50, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32)
    precision = Precision.named("bf16-mixed")
    model = Transformer(config, seed=0, dtype=precision.param_dtype)
    samples = [{"input_ids": list(range(1, 6))}, {"input_ids": list(range(6, 9))}]
    thd = thd_collate([pack_from_segments(samples, ([0, 1], [0, 0], [5, 3]), 8)])
    with precision.autocast(torch.device("cpu")):
        logits_TV = model(thd)
    assert logits_TV.dtype == torch.bfloat16
    logits_TV.float().sum().backward()
    assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in model.parameters()} == {torch.float32}


def test_fsdp_policy_gathers_bf16_and_reduces_fp32():
    policy = Precision.named("bf16-mixed").fsdp_policy()
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert Precision.named("fp32").fsdp_policy() is None


def test_train_precision_defaults_to_fp32_and_is_validated():
    assert TrainConfig().precision == "fp32"
    assert TrainConfig(precision="bf16-mixed").precision == "bf16-mixed"
    with pytest.raises(ValueError, match=r"train\.precision"):
        TrainConfig(precision="bfloat16")


def test_the_removed_dtype_key_is_not_a_field():
    with pytest.raises(TypeError, match="dtype"):
        TrainConfig(dtype="float32")  # type: ignore[call-arg]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: bf16 autocast with the GPU attention kernels")
def test_bf16_mixed_on_cuda_stays_close_to_fp32():
    config = ModelConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256)
    lengths = [37, 5, 80, 6]
    samples = [{"input_ids": [(7 * i + 3 * j) % 500 + 1 for j in range(n)]} for i, n in enumerate(lengths)]
    thd = thd_to_device(thd_collate([pack_from_segments(samples, (range(4), [0] * 4, lengths), 128)]), "cuda")
    losses = {}
    for name in ("fp32", "bf16-mixed"):
        precision = Precision.named(name)
        model = Transformer(config, seed=0, device="cuda", dtype=precision.param_dtype)
        with precision.autocast(torch.device("cuda")):
            logits_TV = model(thd)
        keep = thd["labels"] != -100
        losses[name] = torch.nn.functional.cross_entropy(logits_TV[keep].float(), thd["labels"][keep]).item()
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert abs(losses["bf16-mixed"] - losses["fp32"]) <= 1e-2 * losses["fp32"], losses
