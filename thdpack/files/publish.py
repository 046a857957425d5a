"""Publishing a folder: its files, then a manifest of their checksums written last; and verifying it.

One protocol for every folder thdpack writes (a token store, the token cache, a checkpoint): the
writer retracts the folder first (its manifest goes first, so a reader never meets an old
manifest over new files), writes the files while hashing them, then writes the manifest, every
file's size and sha256 among its fields, atomically (temp file, fsync, rename). A folder is
complete exactly when its manifest exists, and a reader checks each file against its entry
before trusting it. A failed write names its folder and, when the disk is full, says so (the
writers' own errors often name neither). SHA-256 because CPUs with SHA extensions hash it faster
than ``hashlib``'s BLAKE2b.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

CHUNK_BYTES = 1 << 22
"""Bytes per read while hashing: large enough that hashlib releases the GIL and the loop is cheap."""


def file_digest(path: Path, on_chunk: Callable[[memoryview], None] | None = None) -> dict[str, Any] | None:
    """``{"size": bytes, "sha256": hex}`` of ``path``, or None when it is not a file.

    ``on_chunk`` sees every chunk as it is hashed (the store checks token ids in the same pass).
    """
    if not path.is_file():
        return None
    sha = hashlib.sha256()
    size = 0
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            chunk = view[:n]
            sha.update(chunk)
            if on_chunk is not None:
                on_chunk(chunk)
            size += n
    return {"size": size, "sha256": sha.hexdigest()}


class HashingWriter:
    """A binary file that hashes what is written to it; ``digest()`` equals ``file_digest`` of it.

    >>> import io
    >>> w = HashingWriter(io.BytesIO())
    >>> w.write(b"abc")
    3
    >>> w.digest()["sha256"][:16], w.digest()["size"]
    ('ba7816bf8f01cfea', 3)
    """

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self._sha = hashlib.sha256()
        self._size = 0

    def write(self, data: Any) -> int:
        """Write ``data`` (bytes or a C-contiguous buffer such as a numpy array)."""
        view = memoryview(data).cast("B")
        self._sha.update(view)
        self._size += len(view)
        return self.file.write(view)

    def digest(self) -> dict[str, Any]:
        return {"size": self._size, "sha256": self._sha.hexdigest()}


def digest_problem(expected: Mapping[str, Any], actual: Mapping[str, Any] | None, manifest: str) -> str | None:
    """What is wrong with a file whose digest is ``actual`` (None: no such file) and whose entry in
    the manifest named ``manifest`` is ``expected``, as a predicate ("has 10 bytes, ..."); None
    when they agree."""
    if actual is None:
        return "is missing"
    if actual["size"] != expected["size"]:
        return f"has {actual['size']} bytes, {manifest} says {expected['size']}"
    if actual["sha256"] != expected["sha256"]:
        return f"does not match its sha256 in {manifest}"
    return None


def write_text_atomic(path: Path, text: str) -> None:
    """A reader sees the old or the new content of ``path``, never half (temp file, fsync, rename)."""
    partial = path.with_name(f".{path.name}.partial")
    with partial.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def write_json_atomic(path: Path, data: Any) -> None:
    """``data`` as indented JSON (sorted keys), written atomically: how every manifest is written."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def retract(folder: Path, manifest: str) -> None:
    """Make ``folder`` unfinished before its files change or go: its manifest is removed first."""
    (folder / manifest).unlink(missing_ok=True)


def replace_folder(source: Path, target: Path) -> Path:
    """Replace ``target`` by a copy of ``source``: copied beside it, then renamed in, so a reader
    never sees half a folder (a killed copy leaves only ``.<name>.partial``, removed next time)."""
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial)
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    partial.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    return target


LOW_SPACE_BYTES = 64 << 20
"""Free bytes under which a failed write is put down to a full disk (writers fail with messages
such as torch's "unexpected pos 576 vs 534" that do not say ENOSPC)."""


def disk_full_note(folder: Path, error: BaseException, *, by_free_space: bool = True) -> str | None:
    """'the disk that holds ``folder`` ran out of space (N bytes free now)' when ``error`` (or an
    error it wraps) is ENOSPC / EDQUOT, or (``by_free_space``, for writers whose errors carry no errno) that disk
    has under ``LOW_SPACE_BYTES`` free; None otherwise."""
    free = _free_bytes(folder)
    full = any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in wrapped_errors(error))
    if not full and not (by_free_space and free is not None and free < LOW_SPACE_BYTES):
        return None
    shown = "unknown" if free is None else f"{free:,} bytes"
    return f"the disk that holds {folder} ran out of space ({shown} free now)"


def _free_bytes(folder: Path) -> int | None:
    for path in (folder, *folder.parents):  # the folder itself may be gone or unfinished
        try:
            return shutil.disk_usage(path).free
        except OSError:
            continue
    return None


def wrapped_errors(error: BaseException) -> list[BaseException]:
    """``error`` and what it wraps (causes, contexts, torch.distributed.checkpoint's per-rank failures)."""
    out: list[BaseException] = []
    todo: list[Any] = [error]
    while todo:
        e = todo.pop(0)  # breadth first: the outermost errors come first
        if not isinstance(e, BaseException) or any(e is seen for seen in out):
            continue
        out.append(e)
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: exception}
        if isinstance(failures, dict):  # each an exception, or (exception, its stack)
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return out
