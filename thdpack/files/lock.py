"""One writer per folder: an exclusive ``flock`` held from the first byte to the manifest.

A second writer stops at once with ``FolderBusyError`` naming the holder (two runs writing one
folder is a mistake, and waiting could last hours); a builder that expects company (the token
cache) waits instead. The lock file sits beside the folder, so a run that fails before writing
leaves no folder behind. The kernel releases a ``flock`` when its holder dies, so a killed run
never leaves a folder locked; on NFS, Linux maps ``flock`` to byte-range locks, which NFS honours.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class FolderBusyError(ValueError):
    """Another process holds the folder's lock: it is writing the folder now.

    ``folder``: the locked folder; ``problem``: what is wrong, as a predicate ("is being written by
    another process (pid 7 on node3; lock file ...)"); ``fix``: what to do. ``str()`` joins the three.
    """

    def __init__(self, folder: str | os.PathLike[str], problem: str, fix: str) -> None:
        self.folder = Path(folder)
        self.problem = problem
        self.fix = fix
        super().__init__(f"{self.folder} {problem}; {fix}")

    def __reduce__(self) -> tuple[Any, ...]:  # the default would call __init__ with the message only
        return type(self), (self.folder, self.problem, self.fix)


BusyError = Callable[[Path, str, str], Exception]
"""What a busy folder raises, made from (folder, problem, fix): ``FolderBusyError`` unless the
folder's owner names its own (a token store raises ``thdpack.data.manifest.StoreBusyError``)."""


def lock_file_of(folder: str | os.PathLike[str]) -> Path:
    """``.<name>.lock`` beside ``folder``."""
    folder = Path(folder).resolve()
    return folder.with_name(f".{folder.name}.lock")


def _check_folder(folder: Path) -> None:
    """A path naming an existing file cannot be locked as a folder (nor hold one)."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(
            f"{folder} is an existing file, not a folder: it cannot hold files; choose a new or empty folder"
        )


class FolderLock:
    """The exclusive writer's lock of the folder ``folder`` (a context manager).

    ``acquire()`` raises ``busy_error`` naming the holder when another process has it, or with
    ``wait=True`` waits until the holder is done (the trainer's token cache: several machines may
    build the same cache, and the later ones use what the first built).
    """

    def __init__(
        self, folder: str | os.PathLike[str], *, wait: bool = False, busy_error: BusyError = FolderBusyError
    ) -> None:
        self.folder = Path(folder)
        self.file = lock_file_of(folder)
        self.wait = wait
        self.busy_error = busy_error
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> FolderLock:
        _check_folder(self.folder)
        self.file.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if self.wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise self.busy_error(
                    self.folder,
                    f"is being written by another process ({holder}; lock file {self.file})",
                    "wait for it to finish, or write to another folder",
                ) from None
            # the previous holder removes the file on release: if it did so after we opened it,
            # we hold a lock nobody else can see; lock the file that is there now instead
            if _same_file(fd, self.file):
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        self.file.unlink(missing_ok=True)  # while still holding it (see acquire)
        os.close(self._fd)  # closing releases the flock
        self._fd = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


@contextlib.contextmanager
def shared_lock(folder: str | os.PathLike[str], *, busy_error: BusyError = FolderBusyError) -> Iterator[None]:
    """Hold a reader's lock on ``folder`` while reading it; ``busy_error`` while it is written.

    Only folders whose writer left a lock file are locked (a reader never creates one: a store
    may sit on a read-only file system).
    """
    file = lock_file_of(folder)
    try:
        fd = os.open(file, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy_error(
                Path(folder),
                f"is being written by another process ({_holder(fd)}; lock file {file})",
                "wait for it to finish, then run again",
            ) from None
        yield
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "pid unknown"
    except OSError:
        return "pid unknown"


def _same_file(fd: int, path: Path) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)
