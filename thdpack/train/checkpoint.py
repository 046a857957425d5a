"""Checkpoints for exact resume: model, optimizer, scheduler, data stream and every rank's RNG.

Layout of ``<output_dir>/checkpoints/``::

    step_000020/dcp/        model + optimizer, torch.distributed.checkpoint (works for DDP and FSDP2)
    step_000020/trainer.pt  scheduler, data stream, step, config (written by rank 0)
    step_000020/rng/rank_<r>.pt
    latest                  the last complete checkpoint's folder name, written after every rank finished

A checkpoint counts only once ``latest`` names it, so a run killed while saving resumes from
the previous one.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

LATEST = "latest"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass(frozen=True)
class Restored:
    step: int
    trainer: dict[str, Any]


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    keep: int,
) -> Path:
    """Save step ``step`` on every rank (collective); returns its folder."""
    folder = root / f"step_{step:06d}"
    rank = dist.get_rank()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder / "dcp")
    (folder / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), folder / "rng" / f"rank_{rank}.pt")
    if rank == 0:
        torch.save({"step": step, **trainer_state}, folder / "trainer.pt")
    dist.barrier()
    if rank == 0:
        (root / LATEST).write_text(folder.name)
        for old in sorted(root.glob("step_*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return folder


def latest_checkpoint(root: Path) -> Path | None:
    marker = root / LATEST
    if not marker.exists():
        return None
    folder = root / marker.read_text().strip()
    return folder if folder.exists() else None


def _materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazily-allocated state (Adam moments) with a zero step.

    torch.distributed.checkpoint loads into the tensors of a template state dict; a fresh
    optimizer has no moments yet, so without this they would silently not be restored.
    """
    if optimizer.state:
        return
    saved_lr = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, saved_lr, strict=True):
        group["lr"] = lr


def load_checkpoint(folder: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Restored:
    """Restore model, optimizer and this rank's RNG from ``folder``; returns the trainer state."""
    rank = dist.get_rank()
    _materialize_optimizer_state(optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=folder / "dcp")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng_file = folder / "rng" / f"rank_{rank}.pt"
    if not rng_file.exists():
        raise ValueError(f"{folder} has no RNG state for rank {rank}: resume with the world size that saved it")
    set_rng_state(torch.load(rng_file, weights_only=False))
    trainer = torch.load(folder / "trainer.pt", weights_only=False)
    return Restored(step=int(trainer["step"]), trainer=trainer)
