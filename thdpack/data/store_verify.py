"""Checks of a token store's files against its manifest: cheap ones at open, all of them in ``verify_store``.

At open (``TokenStore``): the manifest's fields, every file's size, the offsets' header and ends.
``verify_store`` reads every byte: each file's sha256, every token id below the vocabulary (the
tokenizer's, and the model's when given), every mask byte 0 or 1, every sample at least 2 tokens.
It runs at disk speed or sha256 speed, whichever is slower, one thread per file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from thdpack.data.manifest import (
    LOSS_MASK_FILE,
    MANIFEST_FILE,
    OFFSETS_FILE,
    TOKENS_FILE,
    StoreBusyError,
    StoreError,
    content_files,
    has_checksums,
    read_manifest,
)
from thdpack.files.lock import FolderLock, shared_lock
from thdpack.files.publish import digest_problem, file_digest

log = logging.getLogger(__name__)


def check_sizes(folder: Path, manifest: dict[str, Any]) -> None:
    """Every data file exists with the size the manifest implies (``offsets.npy``: its header too)."""
    num_tokens = manifest["num_tokens"]
    expected = {TOKENS_FILE: num_tokens * np.dtype(manifest["dtype"]).itemsize}
    if manifest["has_loss_mask"]:
        expected[LOSS_MASK_FILE] = num_tokens
    for name, size in expected.items():
        file = folder / name
        if not file.is_file():
            raise StoreError(file, "is missing")
        actual = file.stat().st_size
        if actual != size:
            raise StoreError(file, f"has {actual} bytes, {MANIFEST_FILE} implies {size} (cut short or replaced)")
    _offsets_data_start(folder, manifest)


def _offsets_data_start(folder: Path, manifest: dict[str, Any]) -> int:
    """Check ``offsets.npy``'s header and size; the byte where its values start."""
    file = folder / OFFSETS_FILE
    if not file.is_file():
        raise StoreError(file, "is missing")
    want = (manifest["num_samples"] + 1,)
    try:
        with file.open("rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, fortran_order, dtype = read_header(f)
            start = f.tell()
    except (ValueError, OSError, EOFError, SyntaxError) as err:
        raise StoreError(file, f"has no valid .npy header ({err})") from err
    if shape != want or dtype != np.dtype("<i8") or fortran_order:
        raise StoreError(
            file,
            f"holds {dtype} of shape {shape}; {MANIFEST_FILE} implies int64 of shape {want} "
            f"(num_samples={manifest['num_samples']} plus one)",
        )
    size, expected = file.stat().st_size, start + 8 * want[0]
    if size != expected:
        raise StoreError(file, f"has {size} bytes, its header implies {expected} (cut short or replaced)")
    return start


def check_offsets_ends(file: Path, offsets: np.ndarray, num_tokens: int) -> None:
    """``offsets[0] == 0`` and ``offsets[-1] == num_tokens``: the cheap check at open."""
    if int(offsets[0]) != 0:
        raise StoreError(file, f"starts at {int(offsets[0])}; the first sample starts at token 0")
    if int(offsets[-1]) != num_tokens:
        raise StoreError(file, f"ends at {int(offsets[-1])}; {MANIFEST_FILE} says num_tokens={num_tokens}")


def sample_sizes(file: Path, offsets: np.ndarray) -> np.ndarray:
    """``(N,) int64`` tokens per sample; ``StoreError`` naming the first sample out of order or
    shorter than 2 tokens (the writer stores none shorter)."""
    sizes = np.diff(np.asarray(offsets, dtype=np.int64))
    bad = np.flatnonzero(sizes < 2)
    if len(bad):
        i = int(bad[0])
        a, b = int(offsets[i]), int(offsets[i + 1])
        if b < a:
            problem = f"is out of order at index {i + 1}: offsets[{i + 1}]={b} < offsets[{i}]={a}"
        else:
            problem = f"gives sample {i} {b - a} tokens (offsets[{i}]={a}, offsets[{i + 1}]={b}); every sample has >= 2"
        raise StoreError(file, f"{problem} ({len(bad)} of {len(sizes)} samples bad)")
    return sizes


@dataclass(frozen=True)
class StoreVerification:
    """What ``verify_store`` read and found intact."""

    path: Path
    num_samples: int
    num_tokens: int
    bytes_read: int
    seconds: float
    checksums: bool
    """False for a version-1 store: no checksums, only its structure and token ids were checked."""
    id_limit: int

    def __str__(self) -> str:
        what = "sha256, offsets and token ids" if self.checksums else "offsets and token ids (no checksums: v1)"
        return (
            f"verified {self.path}: {what} of {self.num_samples:,} samples, {self.num_tokens:,} tokens "
            f"(all < {self.id_limit:,}); {self.bytes_read / 1e6:,.1f} MB in {self.seconds:.2f} s"
        )


def verify_store(
    path: str | os.PathLike[str],
    *,
    vocab_size: int | None = None,
    require_checksums: bool = False,
    lock: FolderLock | None = None,
) -> StoreVerification:
    """Read the whole store at ``path`` and check it against its manifest (see the module docstring).

    Args:
        path: the store folder.
        vocab_size: also check every token id is below it (a model's vocabulary); an id the
            store's tokenizer allows but the model does not is a ``ValueError`` (a mismatch, not damage).
        require_checksums: a version-1 store (no checksums) is a ``StoreError`` instead of a warning.
        lock: the folder's writer lock, held by the caller (else a reader's lock is taken, and a
            store being written is a ``StoreBusyError``).

    Returns:
        The ``StoreVerification`` (what was read and checked). Damage is a ``StoreError`` naming the
        file, what is wrong, and what to do.
    """
    folder = Path(path)
    start = time.perf_counter()
    if lock is not None:
        assert lock.held and lock.file == FolderLock(folder).file, "lock must be held, on this folder"
    with contextlib.nullcontext() if lock is not None else shared_lock(folder, busy_error=StoreBusyError):
        manifest = read_manifest(folder)
        if not has_checksums(manifest):
            writer = manifest.get("created_by", "an older thdpack")
            what = f"has no checksums (store version {manifest['version']}, written by {writer})"
            if require_checksums:
                raise StoreError(folder / MANIFEST_FILE, what)
            log.warning(
                "%s %s: checking its structure and token ids only; a changed byte cannot be detected. "
                "Add checksums: `thdpack prepare ... --out %s --overwrite`",
                folder / MANIFEST_FILE,
                what,
                folder,
            )
        check_sizes(folder, manifest)
        # the offsets' order first: a shifted offset is reported at its index, not as a changed file
        offsets = np.load(folder / OFFSETS_FILE, mmap_mode="r")
        check_offsets_ends(folder / OFFSETS_FILE, offsets, manifest["num_tokens"])
        sample_sizes(folder / OFFSETS_FILE, offsets)
        del offsets
        ids = _IdScan(folder, manifest, vocab_size)
        scans = {TOKENS_FILE: ids, LOSS_MASK_FILE: _MaskScan(folder / LOSS_MASK_FILE)}
        names = content_files(manifest)
        # one thread per file: hashlib and numpy release the GIL, so tokens and mask hash side by side
        with ThreadPoolExecutor(max_workers=len(names)) as pool:
            futures = {name: pool.submit(file_digest, folder / name, scans.get(name)) for name in names}
        read = 0
        for name in names:  # a file's scan error (an id out of range) comes first, in file order
            digest = futures[name].result()
            assert digest is not None  # check_sizes saw the file
            read += digest["size"]
            problem = (
                digest_problem(manifest["checksums"][name], digest, MANIFEST_FILE) if has_checksums(manifest) else None
            )
            if problem is not None:
                raise StoreError(folder / name, f"{problem} (its content changed after the store was written)")
        ids.check_recorded(manifest)
        _check_plan_file(folder, manifest)
    return StoreVerification(
        path=folder,
        num_samples=manifest["num_samples"],
        num_tokens=manifest["num_tokens"],
        bytes_read=read,
        seconds=time.perf_counter() - start,
        checksums=has_checksums(manifest),
        id_limit=ids.limit,
    )


def _check_plan_file(folder: Path, manifest: dict[str, Any]) -> None:
    """A prepared plan recorded with a checksum (``thdpack.data.prepared_plan``) matches it."""
    record = manifest.get("plan")
    if isinstance(record, dict) and isinstance(record.get("checksum"), dict) and isinstance(record.get("file"), str):
        file = folder / record["file"]
        problem = digest_problem(record["checksum"], file_digest(file), MANIFEST_FILE)
        if problem is not None:
            raise StoreError(file, problem)


class _IdScan:
    """Sees ``tokens.bin`` chunk by chunk: every id in [0, limit), the minimum and maximum."""

    def __init__(self, folder: Path, manifest: dict[str, Any], vocab_size: int | None) -> None:
        self.file = folder / TOKENS_FILE
        self.folder = folder
        self.dtype = np.dtype(manifest["dtype"])
        self.tokenizer_vocab = int(manifest["tokenizer"]["vocab_size"])
        self.tokenizer_name = manifest["tokenizer"].get("name")
        self.model_vocab = vocab_size
        self.limit = self.tokenizer_vocab if vocab_size is None else min(self.tokenizer_vocab, vocab_size)
        self.seen = 0  # tokens scanned
        self.tail = b""  # bytes of a token split between two reads
        self.lo: int | None = None
        self.hi: int | None = None

    def __call__(self, chunk: memoryview) -> None:
        data = self.tail + bytes(chunk) if self.tail else chunk
        usable = len(data) - len(data) % self.dtype.itemsize
        self.tail = bytes(data[usable:])
        ids = np.frombuffer(data[:usable], dtype=self.dtype)
        if not len(ids):
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.limit:
            self._fail(ids)
        self.lo = lo if self.lo is None else min(self.lo, lo)
        self.hi = hi if self.hi is None else max(self.hi, hi)
        self.seen += len(ids)

    def _fail(self, ids: np.ndarray) -> None:
        i = int(np.flatnonzero((ids < 0) | (ids >= self.limit))[0])
        position, value = self.seen + i, int(ids[i])
        offsets = np.load(self.folder / OFFSETS_FILE, mmap_mode="r")
        sample = int(np.searchsorted(offsets, position, side="right")) - 1
        where = f"holds token id {value} at token {position} (sample {sample})"
        if 0 <= value < self.tokenizer_vocab:
            raise ValueError(
                f"{self.file} {where}, outside the model's vocabulary (vocab_size={self.model_vocab}); the store "
                f"was tokenized by {self.tokenizer_name!r} with {self.tokenizer_vocab} ids: give the model "
                f"vocab_size >= {self.tokenizer_vocab}"
            )
        raise StoreError(
            self.file, f"{where}, outside [0, {self.tokenizer_vocab}) of tokenizer {self.tokenizer_name!r}"
        )

    def check_recorded(self, manifest: dict[str, Any]) -> None:
        """The scanned id range equals the one the writer recorded (version 2)."""
        if not has_checksums(manifest):
            return
        recorded = (manifest["token_ids"].get("min"), manifest["token_ids"].get("max"))
        if recorded != (self.lo, self.hi):
            raise StoreError(
                self.folder / MANIFEST_FILE,
                f"records token ids in [{recorded[0]}, {recorded[1]}], {TOKENS_FILE} holds [{self.lo}, {self.hi}]",
            )


class _MaskScan:
    """Sees ``loss_mask.bin`` chunk by chunk: every byte 0 or 1."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.seen = 0

    def __call__(self, chunk: memoryview) -> None:
        values = np.frombuffer(chunk, dtype=np.uint8)
        if len(values) and int(values.max()) > 1:
            i = int(np.flatnonzero(values > 1)[0])
            raise StoreError(self.file, f"holds {int(values[i])} at byte {self.seen + i}; a mask byte is 0 or 1")
        self.seen += len(values)
