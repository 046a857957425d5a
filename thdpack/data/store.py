"""A memory-mapped token store: every sample's tokens in one file, their offsets in another.

``TokenStoreWriter`` writes a store folder (``tokens.bin``, ``offsets.npy``, ``loss_mask.bin``
for SFT, ``manifest.json`` last with every file's sha256) under the folder's lock;
``TokenStore(path)`` is a read-only ``Sequence`` of samples that maps the files on first access,
so it pickles cheaply into DataLoader workers. A file cut short while mapped would kill the
reader with SIGBUS, so ``check_unchanged()`` names a file whose size, inode or modification time
changed; the trainer calls it before each step's packs.

>>> import tempfile
>>> from thdpack.data.encode import SampleEncoder
>>> encoder = SampleEncoder("gpt2")
>>> folder = tempfile.mkdtemp()
>>> with TokenStoreWriter(folder, tokenizer=encoder.tokenizer) as writer:
...     writer.add_all(encoder.encode([{"text": "Hello world"}, {"text": "Hi"}]))
>>> store = TokenStore(folder)
>>> store.lengths.tolist(), store[0]["input_ids"].tolist(), store[0]["labels"].tolist()
([2, 1], [15496, 995], [995, 50256])
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, overload

import numpy as np

from thdpack._version import __version__
from thdpack.data.encode import SAMPLE_FORMATS, SampleFormat, TokenizedSample
from thdpack.data.manifest import (
    LOSS_MASK_FILE,
    MANIFEST_FILE,
    OFFSETS_FILE,
    STORE_FILES,
    STORE_FORMAT,
    STORE_VERSION,
    TOKENS_FILE,
    StoreBusyError,
    StoreError,
    read_manifest,
    write_manifest,
)
from thdpack.data.store_verify import check_offsets_ends, check_sizes, sample_sizes
from thdpack.data.tokenizer import TextTokenizer
from thdpack.files.lock import FolderLock
from thdpack.files.publish import CHUNK_BYTES, HashingWriter, retract

__all__ = [
    "LOSS_MASK_FILE",
    "MANIFEST_FILE",
    "OFFSETS_FILE",
    "STORE_FILES",
    "STORE_FORMAT",
    "STORE_VERSION",
    "TOKENS_FILE",
    "StoreError",
    "TokenStore",
    "TokenStoreWriter",
    "read_manifest",
    "token_dtype",
    "write_manifest",
]
_CHUNK = 1 << 20  # tokens per buffered write / copy


def _file_identity(path: Path) -> tuple[int, int, int, int]:
    """(device, inode, size, mtime in ns) of ``path``: what changes when it is rewritten or replaced."""
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocab_size <= 65,536), else ``int32``."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


class TokenStore(Sequence[dict[str, np.ndarray]]):
    """Read-only samples of a store folder, memory-mapped on first access.

    Args:
        path: the store folder (``TokenStoreWriter`` / ``thdpack prepare`` wrote it).
        sample_format: override the manifest's ``"labels"`` / ``"loss_mask"``.
    """

    def __init__(self, path: str | os.PathLike[str], *, sample_format: SampleFormat | None = None) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.sample_format: SampleFormat = sample_format or self.manifest["sample_format"]
        if self.sample_format not in SAMPLE_FORMATS:
            raise ValueError(f"unknown sample_format {self.sample_format!r}; use one of {list(SAMPLE_FORMATS)}")
        self.dtype = np.dtype(self.manifest["dtype"])
        self.num_tokens: int = self.manifest["num_tokens"]
        self._num_samples: int = self.manifest["num_samples"]
        check_sizes(self.path, self.manifest)
        self._tokens: np.ndarray | None = None
        self._offsets: np.ndarray | None = None
        self._mask: np.ndarray | None = None
        self._lengths: np.ndarray | None = None
        self._mapped: dict[str, tuple[int, int, int, int]] = {}

    def _open(self) -> None:
        names = [OFFSETS_FILE, *([TOKENS_FILE] if self.num_tokens else [])]
        names += [LOSS_MASK_FILE] if self.manifest["has_loss_mask"] and self.num_tokens else []
        self._mapped = {name: _file_identity(self.path / name) for name in names}
        offsets = np.load(self.path / OFFSETS_FILE, mmap_mode="r")
        check_offsets_ends(self.path / OFFSETS_FILE, offsets, self.num_tokens)
        if self.num_tokens == 0:  # numpy cannot memory-map an empty file
            self._tokens = np.zeros(0, dtype=self.dtype)
        else:
            self._tokens = np.memmap(self.path / TOKENS_FILE, dtype=self.dtype, mode="r")
        if self.manifest["has_loss_mask"] and self.num_tokens:
            self._mask = np.memmap(self.path / LOSS_MASK_FILE, dtype=np.uint8, mode="r")
        self._offsets = offsets

    @property
    def lengths(self) -> np.ndarray:
        """``(N,) int64``: ``len(store[i]["input_ids"])`` for every sample, from the offsets only."""
        if self._lengths is None:
            if self._offsets is None:
                self._open()
            row = sample_sizes(self.path / OFFSETS_FILE, self._offsets)
            self._lengths = row - 1 if self.sample_format == "labels" else row
        return self._lengths

    def __len__(self) -> int:
        return self._num_samples

    def check_unchanged(self) -> None:
        """``StoreError`` naming a memory-mapped file that was cut short, replaced or rewritten since
        it was mapped (reading it could kill the process with SIGBUS); nothing mapped yet: no check."""
        for name, (device, inode, size, mtime) in self._mapped.items():
            file = self.path / name
            try:
                now = _file_identity(file)
            except FileNotFoundError:
                self._changed(file, "was deleted")
            if now[2] != size:
                self._changed(file, f"has {now[2]:,} bytes, {size:,} when it was opened (cut short or rewritten)")
            if now[:2] != (device, inode):
                self._changed(file, "was replaced by another file")
            if now[3] != mtime:
                self._changed(file, "was modified")

    def _changed(self, file: Path, problem: str) -> NoReturn:
        raise StoreError(
            file,
            f"{problem} while this process was reading the store",
            "a store must not change while a run reads it: restore it (or write the new data to another "
            "folder), then continue from the last checkpoint (train.resume=true)",
        )

    @overload
    def __getitem__(self, index: int) -> dict[str, np.ndarray]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[str, np.ndarray]]: ...

    def __getitem__(self, index: int | slice) -> dict[str, np.ndarray] | list[dict[str, np.ndarray]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.tokenized(index).to_sample(self.sample_format)

    def tokenized(self, index: int) -> TokenizedSample:
        """Sample ``index`` as its full token row and target mask."""
        if not isinstance(index, (int, np.integer)):
            raise TypeError(f"store indices must be integers or slices, got {type(index).__name__}")
        i = int(index) + (len(self) if index < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {index} is out of range for a store of {len(self)} samples")
        if self._tokens is None:
            self._open()
        assert self._tokens is not None and self._offsets is not None
        start, end = int(self._offsets[i]), int(self._offsets[i + 1])
        tokens = self._tokens[start:end].astype(np.int64)
        target_mask = np.ones(end - start, dtype=bool) if self._mask is None else self._mask[start:end].astype(bool)
        return TokenizedSample(tokens, target_mask)

    def __getstate__(self) -> dict[str, Any]:
        # memory maps do not pickle well (they would copy the data): each process maps the files itself
        state = self.__dict__.copy()
        state.update(_tokens=None, _offsets=None, _mask=None, _lengths=None, _mapped={})
        return state

    def __repr__(self) -> str:
        return f"TokenStore({str(self.path)!r}, samples={len(self)}, tokens={self.num_tokens})"


class TokenStoreWriter:
    """Streams ``TokenizedSample``s into a new store folder with bounded memory.

    Use as a context manager (an exception removes the partial files) or call ``close()``. The
    writer holds the folder's lock from here until ``close()`` / ``abort()`` (a second writer gets a
    ``StoreBusyError`` naming this one).

    Args:
        path: the store folder.
        tokenizer: the tokenizer the samples were made with (recorded in the manifest).
        sample_format: how readers see the samples: ``"labels"`` or ``"loss_mask"``.
        source: what the samples came from (recorded in the manifest).
        overwrite: replace the store files of a folder that already holds some (False: refuse).
        lock: a ``FolderLock`` of ``path`` the caller already holds (and keeps, to write more files
            beside the store, as ``thdpack prepare`` does).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        tokenizer: TextTokenizer,
        sample_format: SampleFormat = "labels",
        source: Any = None,
        overwrite: bool = False,
        lock: FolderLock | None = None,
    ) -> None:
        if sample_format not in SAMPLE_FORMATS:
            raise ValueError(f"unknown sample_format {sample_format!r}; use one of {list(SAMPLE_FORMATS)}")
        self.path = Path(path)
        if lock is not None:
            assert lock.held and lock.file == FolderLock(self.path).file, "lock must be held, on this folder"
        self._own_lock = FolderLock(self.path, busy_error=StoreBusyError).acquire() if lock is None else None
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            present = [name for name in STORE_FILES if (self.path / name).exists()]
            if present and not overwrite:
                raise FileExistsError(
                    f"{self.path} already holds token store files {present}; pass overwrite=True (--overwrite) "
                    "or choose another folder"
                )
            retract(self.path, MANIFEST_FILE)  # unfinished from here until close() writes the new one
            for name in present:
                (self.path / name).unlink(missing_ok=True)
        except BaseException:
            self._release()
            raise
        self.tokenizer = tokenizer
        self.sample_format = sample_format
        self.source = source
        self.dtype = token_dtype(tokenizer.vocab_size)
        self.num_samples = 0
        self.num_tokens = 0  # flushed and buffered
        self.num_target_tokens = 0
        self.max_length = 0
        self.min_id: int | None = None
        self.max_id: int | None = None
        self._flushed = 0
        self._buffer: list[TokenizedSample] = []
        self._buffered = 0
        # the writer owns its files across add() calls; close() / abort() close them all together
        self._files = contextlib.ExitStack()
        self._tokens_out = HashingWriter(self._files.enter_context(open(self.path / TOKENS_FILE, "wb")))  # noqa: SIM115
        self._offsets_tmp = self._files.enter_context(tempfile.TemporaryFile(dir=self.path))  # noqa: SIM115
        self._mask_out: HashingWriter | None = None
        self._closed = False

    def add(self, sample: TokenizedSample) -> None:
        """Append one sample (at least 2 tokens: the first has nothing before it to be predicted from)."""
        n = len(sample.tokens)
        if n < 2 or sample.tokens.ndim != 1 or sample.target_mask.shape != (n,):
            raise ValueError(
                f"sample {self.num_samples}: tokens must be 1-D with >= 2 entries and target_mask the same "
                f"shape, got tokens {sample.tokens.shape} and target_mask {sample.target_mask.shape}"
            )
        self._buffer.append(sample)
        self._buffered += n
        self.num_samples += 1
        self.num_tokens += n
        self.num_target_tokens += int(np.count_nonzero(sample.target_mask[1:]))
        self.max_length = max(self.max_length, n)
        if self._buffered >= _CHUNK:
            self._flush()

    def add_all(self, samples: Iterable[TokenizedSample]) -> None:
        for sample in samples:
            self.add(sample)

    def _flush(self) -> None:
        if not self._buffer:
            return
        first = self.num_samples - len(self._buffer)
        tokens = np.concatenate([s.tokens for s in self._buffer])
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.tokenizer.vocab_size:
            bad = int(np.flatnonzero((tokens < 0) | (tokens >= self.tokenizer.vocab_size))[0])
            sample_ends = np.cumsum([len(s.tokens) for s in self._buffer])
            which = first + int(np.searchsorted(sample_ends, bad, side="right"))
            raise ValueError(
                f"sample {which} has token id {int(tokens[bad])}, outside [0, {self.tokenizer.vocab_size}) "
                f"of tokenizer {self.tokenizer.name!r}; its eos_id or the records' ids are wrong"
            )
        self.min_id = lo if self.min_id is None else min(self.min_id, lo)
        self.max_id = hi if self.max_id is None else max(self.max_id, hi)
        self._tokens_out.write(tokens.astype(self.dtype))
        ends = self._flushed + np.cumsum([len(s.tokens) for s in self._buffer], dtype=np.int64)
        ends.astype("<i8").tofile(self._offsets_tmp)
        masks = [s.target_mask for s in self._buffer]
        if self._mask_out is None and not all(m.all() for m in masks):
            self._start_mask_file()
        if self._mask_out is not None:
            self._mask_out.write(np.concatenate(masks).astype(np.uint8))
        self._flushed += len(tokens)
        self._buffer, self._buffered = [], 0

    def _start_mask_file(self) -> None:
        """The first sample with a masked token: back-fill 'target' for everything written so far."""
        self._mask_out = HashingWriter(self._files.enter_context(open(self.path / LOSS_MASK_FILE, "wb")))  # noqa: SIM115
        ones = np.ones(_CHUNK, dtype=np.uint8)
        for start in range(0, self._flushed, _CHUNK):
            self._mask_out.write(ones[: min(_CHUNK, self._flushed - start)])

    def _write_offsets(self) -> dict[str, Any]:
        """``offsets.npy`` from the sample ends gathered so far; its checksum."""
        with open(self.path / OFFSETS_FILE, "wb") as f:
            out = HashingWriter(f)
            header = {"descr": "<i8", "fortran_order": False, "shape": (self.num_samples + 1,)}
            np.lib.format.write_array_header_1_0(out, header)
            out.write(np.zeros(1, dtype="<i8"))
            self._offsets_tmp.seek(0)
            while chunk := self._offsets_tmp.read(CHUNK_BYTES):
                out.write(chunk)
        return out.digest()

    def close(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Flush, write ``offsets.npy`` and ``manifest.json`` (with ``extra`` merged in); return it."""
        self._flush()
        checksums = {TOKENS_FILE: self._tokens_out.digest(), OFFSETS_FILE: self._write_offsets()}
        if self._mask_out is not None:
            checksums[LOSS_MASK_FILE] = self._mask_out.digest()
        self._files.close()
        manifest = {
            "format": STORE_FORMAT,
            "version": STORE_VERSION,
            "created_by": f"thdpack {__version__}",
            "tokenizer": {
                "name": self.tokenizer.name,
                "sha256": self.tokenizer.sha256,
                "vocab_sha256": self.tokenizer.vocab_sha256,
                "vocab_size": self.tokenizer.vocab_size,
                "eos_id": self.tokenizer.eos_id,
            },
            "dtype": self.dtype.name,
            "sample_format": self.sample_format,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "num_target_tokens": self.num_target_tokens,
            "max_tokens_per_sample": self.max_length,
            "has_loss_mask": self._mask_out is not None,
            "token_ids": {"min": self.min_id, "max": self.max_id},
            "checksums": checksums,
            "source": self.source,
            **(extra or {}),
        }
        write_manifest(self.path, manifest)
        self._closed = True
        self._release()
        return manifest

    def abort(self) -> None:
        """Close the files and remove what was written (the folder itself stays)."""
        self._files.close()
        retract(self.path, MANIFEST_FILE)
        for name in STORE_FILES:
            (self.path / name).unlink(missing_ok=True)
        self._closed = True
        self._release()

    def _release(self) -> None:
        if self._own_lock is not None:
            self._own_lock.release()

    def __enter__(self) -> TokenStoreWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._closed:
            return
        if exc_type is not None:
            self.abort()
            return
        try:
            self.close()
        except BaseException:
            self.abort()
            raise
