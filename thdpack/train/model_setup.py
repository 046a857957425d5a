"""What a run trains: the model, wrapped for DDP or FSDP2 over the dp x cp world, its AdamW and
its learning-rate schedule.

Every rank builds the model from ``train.seed``, so every replica starts from the same weights; CP
ranks hold the same parameters as their DP peers and sum their gradients with them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from thdpack.models.config import ModelConfig
from thdpack.models.hf.causal_lm import HFModelConfig, build_hf_model
from thdpack.models.transformer import Transformer
from thdpack.train.activation_checkpointing import checkpoint_layers
from thdpack.train.config import Config, TrainConfig
from thdpack.train.precision import Precision
from thdpack.train.runtime import Runtime


def lr_lambda(train: TrainConfig):
    """Linear warmup to ``lr``, then cosine decay to ``min_lr`` at the last step (a factor of lr).

    The schedule counts optimizer steps, as ``train.steps``, ``warmup_steps``, ``stop_at`` and
    ``checkpoint_every`` do: a run resumed with another global batch continues it by steps (each
    step then holds the new number of packs)."""

    def factor(step: int) -> float:
        if step < train.warmup_steps:
            return (step + 1) / train.warmup_steps
        progress = (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps)
        floor = train.min_lr / train.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def build_model(cfg: Config, runtime: Runtime, vocab_size: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(wrapped model, inner model): identical initial weights on every rank, then DDP or FSDP2
    over the whole dp x cp world (CP ranks hold the same parameters and sum their gradients)."""
    model_cfg = cfg.model_config()
    model_vocab = model_vocab_size(model_cfg)
    if model_vocab < vocab_size:  # before building: a large model is not built only to be refused
        raise ValueError(
            f"the model's vocabulary ({model_vocab}) is smaller than the tokenizer's ({vocab_size}); "
            f"set model.vocab_size={vocab_size}, or a data.tokenizer that matches the model"
        )
    precision = Precision.named(cfg.train.precision)
    if isinstance(model_cfg, HFModelConfig):
        inner = build_hf_model(model_cfg, seed=cfg.train.seed, device=runtime.device, dtype=precision.param_dtype)
    else:
        inner = Transformer(model_cfg, seed=cfg.train.seed, device=runtime.device, dtype=precision.param_dtype)
    if cfg.train.activation_checkpointing:
        checkpoint_layers(inner.layers)
    if cfg.parallel.dp_sharding == "fsdp":
        from torch.distributed.fsdp import fully_shard

        policy = precision.fsdp_policy()
        options = {} if policy is None else {"mp_policy": policy}
        for block in inner.layers:
            fully_shard(block, mesh=runtime.world_mesh, **options)
        fully_shard(inner, mesh=runtime.world_mesh, **options)
        return inner, inner
    device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
    return DistributedDataParallel(inner, device_ids=device_ids), inner


def model_vocab_size(model_cfg: ModelConfig | HFModelConfig) -> int:
    """The model's vocabulary, known before it is built (an HF folder's config.json)."""
    return model_cfg.model_vocab_size() if isinstance(model_cfg, HFModelConfig) else model_cfg.vocab_size


def build_optimizer(model: torch.nn.Module, train: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=train.lr, betas=(0.9, 0.95))


@dataclass(frozen=True)
class Training:
    """The model (wrapped for DDP / FSDP2, and the inner module), its optimizer and schedule."""

    model: torch.nn.Module
    inner: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    autocast: Callable[[torch.device], contextlib.AbstractContextManager] | None
    """The forward pass's context under DDP (FSDP2's MixedPrecisionPolicy already computes in bf16)."""


def build_training(cfg: Config, runtime: Runtime, vocab_size: int) -> Training:
    """The model for a tokenizer of ``vocab_size`` words, its AdamW and its schedule (one line on the main
    rank says the model's size and precision)."""
    model, inner = build_model(cfg, runtime, vocab_size)
    optimizer = build_optimizer(model, cfg.train)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.train))
    params = sum(p.numel() for p in inner.parameters())
    runtime.say(f"model: {params:,} parameters, {cfg.model_config()}, precision {cfg.train.precision}")
    precision = Precision.named(cfg.train.precision)
    autocast = None if cfg.parallel.dp_sharding == "fsdp" else precision.autocast
    return Training(model=model, inner=inner, optimizer=optimizer, scheduler=scheduler, autocast=autocast)
