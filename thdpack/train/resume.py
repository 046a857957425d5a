"""Resuming a run: which checkpoint it continues from, what is checked first, and what is restored.

``open_resume`` picks the newest checkpoint whose files all match their checksums
(``open_checkpoints``): damaged or unfinished newer ones are skipped with a warning naming the file
and set aside under ``checkpoints/damaged/``. Its ``trainer.pt`` is then compared with the run
before any weight is loaded (the data, tokenizer and model: ``thdpack.train.identity``).
``resume_training`` restores the model and optimizer (resharded to this run's ranks), the schedule,
the data stream and every rank's RNG.

A checkpoint resumes on another number of ranks, micro-batches or nodes, DDP or FSDP2: the data
stream continues from its global position (``StepStream.load_state_dict``), and a rank the saving
run did not have continues the RNG state of rank ``r % saved ranks``. A resume error on one rank
is raised on every rank (``_on_every_rank``), never on one rank alone.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from thdpack.files.publish import retract, write_text_atomic
from thdpack.files.safe_dcp import load_dcp
from thdpack.files.safe_load import load_plain
from thdpack.packing.step_stream import StepStream
from thdpack.plan.config import PlanConfig
from thdpack.train.checkpoint import (
    DAMAGED,
    LATEST,
    MANIFEST,
    broadcast,
    digests_shared,
    manifest_problems,
    read_manifest,
    read_stream_state,
    read_trainer_state,
    set_rng_state,
    step_folders,
)
from thdpack.train.config import Config
from thdpack.train.identity import check_resume_identity
from thdpack.train.model_setup import Training, lr_lambda
from thdpack.train.runtime import Runtime

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resume:
    """The checkpoint a run continues from, its ``trainer.pt`` read and its identity checked."""

    folder: Path
    trainer: dict[str, Any]
    data_changed: bool
    """The data or tokenizer differ from the checkpoint's and ``train.resume_data_changed`` allows it."""

    @property
    def step(self) -> int:
        return int(self.trainer["step"])


def open_resume(cfg: Config, runtime: Runtime, identity: dict[str, Any]) -> Resume | None:
    """The checkpoint to resume from (``train.resume``), or None to start at step 1.

    Its ``trainer.pt`` is compared with the run before any weight is loaded: the data, tokenizer
    and model it was trained with (``thdpack.train.identity``), and its step with ``train.steps``
    (a checkpoint past the end is refused).
    """
    train = cfg.train
    checkpoints = Path(train.output_dir) / "checkpoints"
    folder = open_checkpoints(checkpoints, resume=train.resume, overwrite=train.overwrite)
    if folder is None:
        if train.resume:
            runtime.say(f"train.resume=true but {checkpoints} holds no checkpoint: starting from step 1")
        return None
    trainer = read_trainer_state(folder)
    changed = check_resume_identity(trainer, identity, folder=folder, data_changed=train.resume_data_changed)
    resume = Resume(folder=folder, trainer=trainer, data_changed=changed)
    if resume.step > train.steps:
        raise ValueError(
            f"checkpoint {folder} is at step {resume.step}, past train.steps={train.steps}; set train.steps above "
            f"{resume.step} to train on from it, or start over with train.overwrite=true"
        )
    return resume


STREAM_SETTING_NAMES = {
    "cp_size": "parallel.cp_size",
    "micro_batches": "train.micro_batches",
    "packs_per_micro_batch": "train.packs_per_micro_batch",
    "dp_size": "data-parallel size (processes / parallel.cp_size)",
    "timing_sha256": "step-time model (packing.profile, packing.model_shape on these nodes)",
    **{key: f"packing.{key}" for key in ("shuffle", "balance", *PlanConfig.__dataclass_fields__)},
}
"""What the trainer's users call each setting of the data stream (``StepStream.load_state_dict``)."""


def resume_training(
    cfg: Config, runtime: Runtime, training: Training, stream: StepStream, resume: Resume | None
) -> int:
    """The first step to run: 1, or the step after the checkpoint ``resume`` (model, optimizer,
    schedule, data stream and RNG restored; with other data, the stream starts at its beginning).

    The checkpoint may come from another layout: another number of processes or nodes, of
    micro-batches, DDP or FSDP2, other packing or CP settings. The stream continues from its global
    position (``StepStream.load_state_dict``: the same packs in the same steps when the packs per
    step and the plan settings are the same, else the rest of the epoch planned again), and one
    line says what changed and what it means."""
    if resume is None:
        return 1
    load_checkpoint(resume.folder, model=training.model, optimizer=training.optimizer)
    scheduler, optimizer = training.scheduler, training.optimizer
    scheduler.load_state_dict(resume.trainer["scheduler"])
    # the schedule of *this* config at the restored step (train.steps may have been extended)
    factor = lr_lambda(cfg.train)(scheduler.last_epoch)
    for group, base_lr in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = base_lr * factor
    if resume.data_changed:
        runtime.say(
            f"resumed from {resume.folder} (step {resume.step}) on other data (train.resume_data_changed=true): "
            "the model, optimizer and schedule continue, the data stream starts at this data's beginning",
        )
    else:
        saved = read_stream_state(resume.folder, resume.trainer)
        change = stream.load_state_dict(saved, names=STREAM_SETTING_NAMES)
        runtime.say(f"resumed from {resume.folder} (step {resume.step})")
        if change.message is not None:
            runtime.say(f"data: {change.message}")
    return resume.step + 1


def open_checkpoints(root: Path, *, resume: bool, overwrite: bool) -> Path | None:
    """The verified checkpoint to resume from, or None to start at step 1 (collective).

    - ``resume``: the newest complete checkpoint whose files all match their checksums. Damaged
      or unfinished newer ones are skipped with a warning naming the file, then moved to
      ``root/damaged/`` (the resumed run replaces them; pruning never counts them). ``ValueError``
      naming every damaged file when ``root`` holds checkpoint folders but none is valid; None
      when it holds none.
    - otherwise ``root`` must be empty (another run's checkpoints would be mixed with this one's
      and pruned away): ``ValueError`` naming the folder and the choices, unless ``overwrite``,
      which deletes them.

    On every rank the decision is the same: rank 0 reads the folder, the files are hashed by all.
    """
    rank = dist.get_rank()
    entries, folders = broadcast((_entries(root), step_folders(root)) if rank == 0 else None)
    if not resume:
        if entries and not overwrite:
            raise ValueError(
                f"{root} holds the checkpoints of an earlier run ({_names(entries)}); continue it with "
                "train.resume=true, write to a new train.output_dir, or delete them with train.overwrite=true"
            )
        if entries and rank == 0:
            log.warning("train.overwrite=true: deleting %s (%s)", root, _names(entries))
            for folder in folders:  # first: a removal cut short must not leave a complete checkpoint
                retract(folder, MANIFEST)
            shutil.rmtree(root)
        dist.barrier()
        return None
    damaged: list[str] = []
    skipped: list[Path] = []
    for folder in reversed(folders):
        manifest, why = broadcast(read_manifest(folder) if rank == 0 else None)
        problems = (
            [why] if manifest is None else manifest_problems(folder, manifest, digests_shared(folder, _files(manifest)))
        )
        if not problems:
            if rank == 0:
                _set_aside(root, skipped)
                _point_latest_at(root, folder)
            dist.barrier()
            return folder
        damaged.extend(problems)
        skipped.append(folder)
        _warn(f"skipping checkpoint {folder.name}: {'; '.join(problems)}")
    if damaged:
        raise ValueError(
            f"no valid checkpoint in {root}: {'; '.join(damaged)}; restore the files, "
            "or start over with train.overwrite=true or a new train.output_dir"
        )
    return None


def _files(manifest: dict[str, Any]) -> list[str]:
    return sorted(manifest["files"])


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def _warn(text: str) -> None:
    if dist.get_rank() == 0:
        log.warning(text)


def _names(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _set_aside(root: Path, skipped: list[Path]) -> None:
    """Move the skipped (damaged or unfinished) checkpoints to ``root/damaged/``, out of resume's
    and pruning's way; a same-named older one there is replaced."""
    if not skipped:
        return
    aside = root / DAMAGED
    aside.mkdir(exist_ok=True)
    for folder in skipped:
        target = aside / folder.name
        if target.exists():
            shutil.rmtree(target)
        os.replace(folder, target)
    log.warning("moved %s to %s (inspect, then delete)", _names([f.name for f in skipped]), aside)


def _point_latest_at(root: Path, folder: Path) -> None:
    marker = root / LATEST
    named = marker.read_text().strip() if marker.is_file() else None
    if named != folder.name:
        log.warning("%s named %r; it now names %s, the checkpoint this run resumes from", marker, named, folder.name)
        write_text_atomic(marker, folder.name)


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


def _on_every_rank(action: Callable[[], Any]) -> Any:
    """``action()`` on every rank (collective); a ``ValueError`` it raises on any rank is raised on
    every rank, naming the ranks it came from when not all: no rank stops alone, leaving the others
    to fail on a closed connection."""
    result, error = None, None
    try:
        result = action()
    except ValueError as err:
        error = str(err)
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    said: dict[str, list[int]] = {}
    for rank, message in enumerate(errors):
        if message is not None:
            said.setdefault(message, []).append(rank)
    if said:
        everyone = len(said) == 1 and len(next(iter(said.values()))) == len(errors)
        raise ValueError(
            "; ".join(m if everyone else f"{m} (on rank {', '.join(map(str, r))})" for m, r in said.items())
        )
    return result


def rng_file_of(folder: Path, rank: int, manifest: dict[str, Any]) -> Path:
    """The RNG state rank ``rank`` resumes from: its own, or for a rank the saving run did not have,
    rank ``rank % saved ranks``'s (every rank of a run is seeded alike with ``train.seed``, so that is
    the state it would hold had it been there)."""
    saved = sorted(int(name[len("rng/rank_") : -len(".pt")]) for name in manifest["files"] if name.startswith("rng/"))
    if not saved:
        raise ValueError(f"{folder} holds no RNG state (rng/rank_<r>.pt); resume from a checkpoint thdpack wrote")
    return folder / "rng" / f"rank_{rank if rank in saved else saved[rank % len(saved)]}.pt"


def load_checkpoint(folder: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Restore model, optimizer and this rank's RNG from ``folder`` on any number of ranks
    (collective). Every rank raises the same ``ValueError`` when one cannot load its part."""
    rank = dist.get_rank()
    _materialize_optimizer_state(optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    load_dcp(state, folder / "dcp")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    manifest, why = read_manifest(folder)
    if manifest is None:
        raise ValueError(why)
    rng_file = rng_file_of(folder, rank, manifest)
    _on_every_rank(lambda: set_rng_state(load_plain(rng_file)))
    saved = manifest.get("world_size")
    if rank == 0 and isinstance(saved, int) and saved < dist.get_world_size():
        log.info(
            "checkpoint %s was saved by %d ranks: ranks %d..%d continue the RNG state of rank r %% %d (every rank "
            "is seeded alike with train.seed)",
            folder,
            saved,
            saved,
            dist.get_world_size() - 1,
            saved,
        )
