"""One optimizer step's forward and backward on packed, CP-sharded THD micro-batches.

The trainer runs these functions and so does ``thdpack verify``, so what verify proves exact is
the training step itself (:class:`StepHooks` are where verify plants known faults).
``prepare_micro_batches`` gives each global micro-batch its loss weights, shards it and moves it;
``forward_backward`` counts the step's loss tokens with one collective (``StepLoss``) and
back-propagates each micro-batch's ``sum(token losses) / denominator * grad_average_size``
(DDP / FSDP2 average, the step's gradient is a sum), synchronising gradients on the last
micro-batch only.

Legend: ``T`` tokens of a micro-batch on this rank, ``V`` vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from thdpack.cp.partition import shard
from thdpack.cp.topology import CpTopology
from thdpack.loss import StepLoss, loss_weights
from thdpack.thd.batch import thd_collate, thd_to_device
from thdpack.thd.carriage import thd_meta
from thdpack.thd.format import THDBatch


@dataclass(frozen=True)
class StepHooks:
    """Where ``thdpack verify`` plants a known fault; each default is the training step's own."""

    shard: Callable[[THDBatch, int, int], THDBatch] = shard
    """``(global micro-batch, cp_size, cp_rank) -> this rank's batch``."""
    loss: Callable[[StepLoss, torch.Tensor, THDBatch], torch.Tensor] | None = None
    """``(step_loss, logits_TV, micro-batch) -> the loss to backward``; None: ``step_loss(...)``."""
    logits: Callable[[int, torch.Tensor, THDBatch], None] | None = None
    """Observes ``(micro-batch index, logits_TV, micro-batch)`` after each forward."""


NO_HOOKS = StepHooks()


def prepare_micro_batches(
    micro_batches: Sequence[THDBatch],
    *,
    topology: CpTopology,
    device: torch.device,
    reduction: str,
    hooks: StepHooks = NO_HOOKS,
) -> list[THDBatch]:
    """This rank's CP shards (``topology.cp_rank`` of ``cp_size``) of the step's GLOBAL THD
    micro-batches, on ``device``.

    Metadata (cu_seqlens, max_seqlen, per-sequence loss weights) comes from the whole
    micro-batch, before sharding, so every CP rank agrees on it.
    """
    out = []
    for thd in micro_batches:
        if reduction == "sequence_mean" and "loss_weights" not in thd:
            thd = {**thd, "loss_weights": loss_weights(thd["labels"], thd_meta(thd), reduction=reduction)}
        out.append(thd_to_device(hooks.shard(thd, topology.cp_size, topology.cp_rank), device))
    return out


def micro_step_context(model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Gradient synchronisation on (``sync``) or off for this micro-step, under DDP or FSDP2."""
    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if sync else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def forward_backward(
    model: torch.nn.Module,
    micro: Sequence[THDBatch],
    *,
    topology: CpTopology,
    hooks: StepHooks = NO_HOOKS,
    autocast: Callable[[torch.device], contextlib.AbstractContextManager] | None = None,
) -> StepLoss:
    """Forward and backward of one optimizer step's micro-batches (this rank's shards).

    ``topology``: the run's ``CpTopology``: the model's CP groups, the DP x CP group whose loss
    tokens make the denominator, and ``grad_average_size``, every rank, which the gradient
    reduction of ``model`` (DDP / FSDP2 over the flattened mesh) averages over; ``autocast``:
    ``device -> context`` the forward pass runs in (``Precision.autocast``;
    the loss is computed outside it, in fp32 or wider). Gradients end up synchronised. Returns
    the step's ``StepLoss`` (``.value()`` is the global loss, ``.loss_tokens`` the global count
    of loss tokens).
    """
    per_sequence = "loss_weights" in micro[0]
    step_loss = StepLoss.begin(
        [mb["labels"] for mb in micro],
        topology=topology,
        micro_batch_weights=[mb["loss_weights"] for mb in micro] if per_sequence else None,
    )
    for k, mb in enumerate(micro):
        with micro_step_context(model, sync=k == len(micro) - 1):
            with contextlib.nullcontext() if autocast is None else autocast(mb["input_ids"].device):
                logits_TV = model(mb, cp_group=topology)
            if hooks.logits is not None:
                hooks.logits(k, logits_TV, mb)
            if hooks.loss is None:
                loss = step_loss(logits_TV, mb["labels"], mb.get("loss_weights"))
            else:
                loss = hooks.loss(step_loss, logits_TV, mb)
            loss.backward()
    return step_loss


def clip_grad_norm(model: torch.nn.Module, clip: float) -> torch.Tensor:
    """Clip the gradients' global norm to ``clip`` (0: no clipping); returns the norm before it as
    a 0-d tensor on the device, so that the optimizer step is queued before anything reads it."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
        norm = norm.full_tensor()
    return norm


def parameters_finite(model: torch.nn.Module) -> torch.Tensor:
    """0-d bool tensor on the device, True when every parameter is finite (no host sync: the
    trainer reads it back with the step's loss). Under FSDP2 every rank checks its shards and the ranks agree
    (one all-reduce), so that all of them stop together."""
    params = [p.detach() for p in model.parameters()]
    sharded = any(hasattr(p, "to_local") for p in params)  # DTensors under FSDP2
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    finite = torch.stack([torch.isfinite(p).all() for p in local]).all()
    if sharded:
        flag = finite.to(torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        finite = flag.bool()
    return finite


def nonfinite_parameters(model: torch.nn.Module) -> list[str]:
    """Names of the parameters (this rank's shards under FSDP2) that hold a NaN or an infinity."""
    out = []
    for name, p in model.named_parameters():
        local = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
        if not bool(torch.isfinite(local).all()):
            out.append(name)
    return out


def global_grad_norm(model: torch.nn.Module, clip: float) -> float:
    """:func:`clip_grad_norm` read back as a float (a host sync)."""
    return float(clip_grad_norm(model, clip))


def collate_micro_batches(micro_batches: Sequence[Sequence[Any]]) -> list[THDBatch]:
    """``thd_collate`` of each micro-batch's packs (the trainer's global micro-batches)."""
    return [thd_collate(list(packs)) for packs in micro_batches]
