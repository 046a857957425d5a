"""A checkpoint's files: its layout, how it is saved and published, and how it is verified.

Layout of ``<output_dir>/checkpoints/``::

    step_000020/dcp/          model + optimizer, torch.distributed.checkpoint (works for DDP and FSDP2,
                              and loads on any number of ranks: it reshards)
    step_000020/trainer.pt    scheduler, step, config and the run's identity: its data, tokenizer
                              and model (``thdpack.train.identity``; rank 0)
    step_000020/stream.json   the data stream's position: the epoch, its plan's settings, the
    step_000020/stream.npz    consumed pieces of its sequences and their digest (JSON and arrays,
                              ``thdpack.files.state_file``; ``thdpack checkpoint info`` prints it)
    step_000020/rng/rank_<r>.pt
    step_000020/checksums.json  size and sha256 of every file above, written last
    latest                    the newest complete checkpoint's folder name
    damaged/step_000040/      a checkpoint that resume found damaged or unfinished, set aside

A checkpoint is published the way every thdpack folder is (``thdpack.files.publish``): complete once
its ``checksums.json`` exists; rank 0 writes it (atomically) after every rank finished writing, so
a run killed while saving leaves a folder without it. ``latest`` is rewritten (atomically) after
each manifest and on resume: a pointer for people and tools, which resume does not trust
(``thdpack.train.resume`` verifies every file). ``verify_checkpoint(folder)`` runs that check on its
own. Checksums catch accidents, not a crafted folder: every file is read back as tensors and plain
values only (``thdpack.files.safe_load``, ``thdpack.files.safe_dcp``).

One output_dir holds the checkpoints of one run, so pruning (keep the newest ``keep_checkpoints``)
never mixes runs. A save that fails (a full disk: torch says only "unexpected pos 576 vs 534")
raises ``CheckpointSaveError`` naming the folder and, when the disk is full, saying so; its
partial files are removed.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from thdpack.files.publish import (
    digest_problem,
    disk_full_note,
    file_digest,
    retract,
    wrapped_errors,
    write_json_atomic,
    write_text_atomic,
)
from thdpack.files.safe_load import load_plain
from thdpack.files.state_file import read_state, write_state
from thdpack.packing.step_stream import StreamState

LATEST = "latest"
MANIFEST = "checksums.json"
DAMAGED = "damaged"
CHECKPOINT_FORMAT = "thdpack-checkpoint"
CHECKPOINT_VERSION = 1
REQUIRED_FILES = ("trainer.pt", "dcp/.metadata")
"""Files every checkpoint's manifest lists (the rank files depend on the world size)."""
STREAM_FILE = "stream.json"
"""The data stream's state in a checkpoint (with ``stream.npz``); older checkpoints hold it in ``trainer.pt``."""
_STEP_FOLDER = re.compile(r"step_(\d+)")


def rng_state() -> dict[str, Any]:
    """Every generator's state as tensors and plain values (``load_plain`` reads it back: no numpy objects)."""
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = torch.from_numpy(numpy_state["state"]["key"].astype(np.int64))
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore every generator from ``rng_state()``'s record."""
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    key = numpy_state["state"]["key"].numpy().astype(np.uint32)
    np.random.set_state({**numpy_state, "state": {**numpy_state["state"], "key": key}})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # one state per GPU the saving process saw: a node with fewer GPUs restores as many as it has
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, a failing file system); names the folder."""


# -- files, manifests, verification --------------------------------------------------------


def step_folders(root: Path) -> list[Path]:
    """``root``'s ``step_<n>`` folders, oldest step first (complete or not)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_FOLDER.fullmatch(p.name)]
    return sorted(found, key=step_of)


def step_of(folder: Path) -> int:
    return int(_STEP_FOLDER.fullmatch(folder.name).group(1))  # type: ignore[union-attr]


def read_manifest(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) for a complete checkpoint, else (None, why it is not one)."""
    file = folder / MANIFEST
    if not file.is_file():
        return None, f"{file} is missing (a save that did not finish)"
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"{file} is unreadable ({err})"
    if not _is_manifest(manifest):
        return None, f"{file} is not a {CHECKPOINT_FORMAT} v{CHECKPOINT_VERSION} manifest"
    named = _STEP_FOLDER.fullmatch(folder.name)
    if named and manifest["step"] != int(named.group(1)):
        return None, f"{file} is for step {manifest['step']}, not {int(named.group(1))}"
    files = manifest["files"]
    missing = [name for name in REQUIRED_FILES if name not in files]
    if missing:
        return None, f"{file} does not list {', '.join(missing)}"
    return manifest, None


def _is_manifest(manifest: Any) -> bool:
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return False
    entries_ok = all(
        isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
        for e in manifest["files"].values()
    )
    header_ok = manifest.get("format") == CHECKPOINT_FORMAT and manifest.get("version") == CHECKPOINT_VERSION
    return entries_ok and header_ok and isinstance(manifest.get("step"), int)


def manifest_problems(folder: Path, manifest: dict[str, Any], digests: dict[str, dict[str, Any] | None]) -> list[str]:
    found = ((name, digest_problem(expected, digests[name], MANIFEST)) for name, expected in manifest["files"].items())
    return [f"{folder / name} {problem}" for name, problem in found if problem is not None]


def verify_checkpoint(folder: str | os.PathLike[str]) -> list[str]:
    """Problems of the checkpoint ``folder`` (``[]``: complete and intact), each naming a file.

    Reads every file the manifest lists and compares its size and sha256; one process, no
    ``torch.distributed`` needed.
    """
    folder = Path(folder)
    manifest, why = read_manifest(folder)
    if manifest is None:
        return [why]  # type: ignore[list-item]
    return manifest_problems(folder, manifest, {name: file_digest(folder / name) for name in manifest["files"]})


def digests_shared(folder: Path, names: list[str]) -> dict[str, dict[str, Any] | None]:
    """``file_digest`` of ``folder / name`` for every name, the reading split over the ranks.

    Collective; every rank passes the same ``names`` and gets every digest.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {name: file_digest(folder / name) for name in names[rank::world]}
    parts: list[dict[str, Any] | None] = [None] * world
    dist.all_gather_object(parts, mine)
    return {name: digest for part in parts for name, digest in part.items()}  # type: ignore[union-attr]


def broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (the file system is read once, every rank decides alike)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _remove(folder: Path) -> None:
    """Delete a checkpoint folder, its manifest first: an interrupted removal leaves it incomplete."""
    retract(folder, MANIFEST)
    shutil.rmtree(folder, ignore_errors=True)


# -- save --------------------------------------------------------------------------------


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    stream: StreamState,
    keep: int,
    export: Callable[[Path], None] | None = None,
) -> Path:
    """Save step ``step`` on every rank (collective); returns its folder. ``stream``: the data
    stream's state right after the step (rank 0 writes it, ``STREAM_FILE``).

    ``export(folder)`` (collective, optional) writes more files into the folder before the
    checksums are taken, so they are verified and pruned with it (the Hugging Face folder of a
    ``model=hf`` run, ``thdpack.train.export``).

    Order: every rank writes its files; rank 0 lists them, every rank hashes a share, rank 0
    writes ``checksums.json`` then ``latest`` (both atomically) and prunes to the ``keep``
    newest complete checkpoints up to ``step``, this one always included.
    """
    folder = root / f"step_{step:06d}"
    rank = dist.get_rank()
    if rank == 0 and folder.exists():  # not expected (resume sets later folders aside): never mix in its files
        _remove(folder)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder / "dcp")
        (folder / "rng").mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), folder / "rng" / f"rank_{rank}.pt")
        if rank == 0:
            torch.save({"step": step, **trainer_state}, folder / "trainer.pt")
            write_state(folder / STREAM_FILE, stream.state_dict())
        if export is not None:
            export(folder)
    except (OSError, RuntimeError, CheckpointException) as err:
        failure = _save_failed(folder, err)
        _remove(folder)  # frees what it took; resume would set it aside anyway (no checksums.json)
        raise failure from err
    dist.barrier()
    names = broadcast(sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()))
    digests = digests_shared(folder, names)
    if rank == 0:
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "step": step,
            "world_size": dist.get_world_size(),
            "files": digests,
        }
        write_json_atomic(folder / MANIFEST, manifest)
        write_text_atomic(root / LATEST, folder.name)
        _prune(root, step, keep)
    dist.barrier()
    return folder


def _save_failed(folder: Path, error: BaseException) -> CheckpointSaveError:
    """What to tell the user when writing ``folder`` failed with ``error`` (torch's own words for a
    full disk, "unexpected pos 576 vs 534", name neither the file nor the cause)."""
    inner = next((e for e in wrapped_errors(error) if not isinstance(e, CheckpointException)), error)
    said = (str(inner).strip().splitlines() or ["no message"])[0]
    cause = disk_full_note(folder.parent, error)
    fix = "free space there, or set train.output_dir to a larger disk" if cause else "check that file system"
    return CheckpointSaveError(
        f"could not save checkpoint {folder}: {cause or 'writing it failed'} ({type(inner).__name__}: {said}); "
        f"{fix}, then continue from the last complete checkpoint with train.resume=true (the files of this "
        "unfinished one were removed)"
    )


def read_trainer_state(folder: Path) -> dict[str, Any]:
    """The ``trainer.pt`` of checkpoint ``folder``: step, scheduler, config, identity."""
    return load_plain(folder / "trainer.pt")


def read_stream_state(folder: Path, trainer: dict[str, Any]) -> dict[str, Any]:
    """The data stream's state saved in checkpoint ``folder`` (its ``trainer.pt``'s ``trainer`` holds
    it in checkpoints written before ``STREAM_FILE``)."""
    if (folder / STREAM_FILE).is_file() or "stream" not in trainer:
        return read_state(folder / STREAM_FILE)
    return trainer["stream"]


def _prune(root: Path, step: int, keep: int) -> None:
    """Keep the ``keep`` newest complete checkpoints up to ``step`` (``step`` itself always);
    remove the older ones and unfinished leftovers. Later steps are not this run's to judge."""
    kept = 0
    for folder in reversed(step_folders(root)):
        if step_of(folder) > step:
            continue
        if step_of(folder) == step or (kept < keep and read_manifest(folder)[0] is not None):
            kept += 1
        else:
            _remove(folder)
