"""One run per output_dir: rank 0 holds the folder's lock for the run's lifetime.

Two runs writing one ``train.output_dir`` would interleave ``metrics.jsonl`` and prune each
other's checkpoints. Rank 0 takes the folder's lock (``thdpack.files.lock.FolderLock``, an
exclusive ``flock``) before anything is written and holds it until the run ends; the other ranks
learn the outcome from rank 0, so a second run stops at once on every rank, naming the first.
Only rank 0 locks: a run's ranks share the folder by design. A run that dies never blocks the
next, since the kernel releases a ``flock`` with its holder. The Trainer integrations hold their
``output_dir`` the same way and also refuse a folder holding another run's ``checkpoint-N``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch.distributed as dist

from thdpack.files.lock import FolderBusyError, FolderLock


def lock_output_dir(out: Path, setting: str = "train.output_dir") -> FolderLock:
    """Create ``out`` and take its lock; ``ValueError`` naming the path (as ``setting``) when it
    cannot be written (a read-only file system, no permission, a file of that name),
    ``FolderBusyError`` when another process holds it."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = FolderLock(out).acquire()
    except OSError as err:
        raise _unwritable(out, err, setting) from err
    try:  # an existing folder on a read-only file system passes the above
        probe = out / ".thdpack-write-test"
        probe.touch()
        probe.unlink()
    except OSError as err:
        lock.release()
        raise _unwritable(out, err, setting) from err
    return lock


def _unwritable(out: Path, err: OSError, setting: str) -> ValueError:
    return ValueError(
        f"{setting}={out} cannot be written ({err.strerror or err}: {err.filename or out}); "
        "choose a folder this process can write"
    )


@contextlib.contextmanager
def hold_output_dir(
    out: Path, *, is_main: bool, setting: str = "train.output_dir", check: Callable[[], None] | None = None
) -> Iterator[None]:
    """Hold ``out``'s lock on the main rank while the body runs (collective when
    ``torch.distributed`` is initialized: every rank calls it and every rank raises the same
    ``ValueError`` when ``out`` is unwritable, another run holds it, or ``check`` (called on the
    main rank under the lock) refuses it). ``setting``: what the user calls the folder."""
    lock: FolderLock | None = None
    refusal: str | None = None
    if is_main:
        try:
            lock = lock_output_dir(out, setting)
            if check is not None:
                check()
        except FolderBusyError as err:
            refusal = (
                f"{setting}={out} {err.problem}: another training run is using it; wait for it to "
                f"finish, or choose another {setting}"
            )
        except ValueError as err:
            refusal = str(err)
        if refusal is not None and lock is not None:
            lock.release()
            lock = None
    box = [refusal]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise ValueError(box[0])
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
