"""Where records come from: jsonl, json, parquet, HF ``save_to_disk`` folders, text, the stdlib.

A ``Source`` is a re-iterable stream of records (plain ``dict``s, the shape they have on disk)
from one path, read with bounded memory; ``"auto"`` tells the format from the path. ``stdlib`` is
the running interpreter's standard library, a real, heavy-tailed code corpus present wherever
Python is (thdpack's default training data). Nothing is dropped silently: empty records are
counted in ``Source.report``, undecodable bytes raise naming the file and line (unless
``decode_errors="replace"``, counted), and a line that is not a JSON object goes to the
``BadRecords`` policy. The formats: docs/guides/hugging-face.md.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import sysconfig
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal, get_args

from thdpack._optional import require
from thdpack.data._json_array import iter_json_array
from thdpack.data.bad_records import BadRecord, BadRecords, RecordOrigin
from thdpack.data.records import has_kind_fields

SourceFormat = Literal["jsonl", "json", "parquet", "hf", "text", "stdlib"]
SOURCE_FORMATS: tuple[str, ...] = get_args(SourceFormat)
DecodeErrors = Literal["strict", "replace"]
STDLIB = "stdlib"

_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_SKIPPED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True, kw_only=True)
class SourceConfig:
    """How to read one input path."""

    format: SourceFormat | Literal["auto"] = "auto"
    """One of ``SOURCE_FORMATS``, or ``"auto"`` to tell it from the path."""
    decode_errors: DecodeErrors | None = None
    """Bytes that are not UTF-8: ``"strict"`` raises, ``"replace"`` writes U+FFFD and counts the
    document. ``None``: ``"replace"`` for ``stdlib``, ``"strict"`` for everything else."""
    text_suffixes: tuple[str, ...] | None = None
    """``text`` folders: read only files with these suffixes (e.g. ``(".txt", ".md")``); None = all."""
    split: str | None = None
    """``hf`` folders holding a ``DatasetDict``: the split to read (optional when there is one)."""

    def __post_init__(self) -> None:
        if self.format not in (*SOURCE_FORMATS, "auto"):
            raise ValueError(f"unknown source format {self.format!r}; use one of {['auto', *SOURCE_FORMATS]}")
        if self.decode_errors not in (None, *get_args(DecodeErrors)):
            raise ValueError(f"unknown decode_errors {self.decode_errors!r}; use one of {list(get_args(DecodeErrors))}")
        if self.text_suffixes is not None and not all(s.startswith(".") for s in self.text_suffixes):
            raise ValueError(f"text_suffixes must start with '.', got {self.text_suffixes}")


@dataclass
class SourceReport:
    """What one pass over a source read and skipped."""

    records: int = 0
    """Records yielded."""
    skipped_empty: int = 0
    """Records / documents skipped because they hold no text and no values."""
    blank_lines: int = 0
    """Blank lines between jsonl records (not records; counted so nothing goes unseen)."""
    decode_replaced: int = 0
    """Documents whose undecodable bytes were replaced by U+FFFD (``decode_errors="replace"``)."""
    skipped_bad: int = 0
    """Lines skipped as bad records (not JSON, not an object) under ``on_bad_record="skip"``."""

    def __str__(self) -> str:
        parts = [f"{self.records} records", f"{self.skipped_empty} empty skipped"]
        if self.blank_lines:
            parts.append(f"{self.blank_lines} blank lines")
        if self.decode_replaced:
            parts.append(f"{self.decode_replaced} with undecodable bytes replaced")
        if self.skipped_bad:
            parts.append(f"{self.skipped_bad} bad skipped")
        return ", ".join(parts)


def stdlib_root() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def detect_format(path: str | os.PathLike[str]) -> SourceFormat:
    """Tell a source's format from its path (see the module table); ``ValueError`` when unclear.

    >>> detect_format("stdlib")
    'stdlib'
    """
    p = Path(path)
    if str(path) == STDLIB and not p.exists():
        return "stdlib"
    if not p.exists():
        raise FileNotFoundError(f"input {str(path)!r} does not exist (for the embedded corpus pass {STDLIB!r})")
    if p.is_dir():
        return "hf" if any((p / m).is_file() for m in _HF_MARKERS) else "text"
    suffixes = [s.lower() for s in p.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes.pop()
    suffix = suffixes[-1] if suffixes else ""
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix == ".json":
        with _open_binary(p) as f:
            head = f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()
        return "json" if head.startswith(b"[") else "jsonl"
    if suffix == ".parquet":
        return "parquet"
    if suffix in (".txt", ".md", ".py", ".rst"):
        return "text"
    raise ValueError(
        f"cannot tell the format of {str(path)!r} from its name; pass format= (--format) one of {list(SOURCE_FORMATS)}"
    )


class Source:
    r"""Records from one path, re-iterable; ``report`` counts the last (or current) pass.

    Args:
        path: a file, a folder, or ``"stdlib"`` (the formats: the module docstring).
        config: the source's settings (``SourceConfig``: format, record kind, ...).
        bad_records: the bad-record policy and tally to use (shared with the encoder of the same pass).

    >>> import pathlib, tempfile
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (folder / "a.jsonl").write_text('{"text": "hi"}\n{"text": ""}\n')
    >>> src = Source(folder / "a.jsonl")
    >>> list(src)
    [{'text': 'hi'}]
    >>> str(src.report)
    '1 records, 1 empty skipped'
    """

    def __init__(
        self, path: str | os.PathLike[str], config: SourceConfig | None = None, *, bad_records: BadRecords | None = None
    ) -> None:
        self.config = config or SourceConfig()
        self.bad_records = bad_records or BadRecords("fail")
        """Fails on, or skips and counts, lines that are not JSON objects (shared with the encoder)."""
        self.path = Path(path)
        if self.config.format == "auto":
            self.format: SourceFormat = detect_format(path)
        elif self.config.format == "stdlib":
            if str(path) != STDLIB:
                raise ValueError(
                    "format='stdlib' reads the interpreter's standard library; "
                    f"pass {STDLIB!r} as the input, not {str(path)!r}"
                )
            self.format = "stdlib"
        else:
            if not self.path.exists():
                raise FileNotFoundError(f"input {str(path)!r} does not exist")
            self.format = self.config.format
        if self.format == "stdlib":
            self.path = stdlib_root()
        self.decode_errors: DecodeErrors = self.config.decode_errors or (
            "replace" if self.format == "stdlib" else "strict"
        )
        self.report = SourceReport()

    def describe(self) -> dict[str, Any]:
        """A JSON-able description for manifests."""
        out: dict[str, Any] = {"format": self.format, "path": str(self.path.resolve())}
        if self.format == "stdlib":
            out["python"] = sys.version.split()[0]
        if self.config.split is not None:
            out["split"] = self.config.split
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for _, record in self.records_with_origin():
            yield record

    def records_with_origin(self) -> Iterator[tuple[RecordOrigin, dict[str, Any]]]:
        """Yield ``(origin, record)``; ``origin`` (a ``RecordOrigin``) says where the record is
        ("data.jsonl line 7")."""
        self.report = SourceReport()
        readers = {
            "jsonl": self._jsonl,
            "json": self._json,
            "parquet": self._parquet,
            "hf": self._hf,
            "text": self._text,
            "stdlib": self._text,
        }
        for origin, record in readers[self.format]():
            if not isinstance(record, (Mapping, BadRecord)):
                kind = type(record).__name__
                record = BadRecord(origin, "not_an_object", f"expected a JSON object (a mapping), got {kind}")
            if isinstance(record, BadRecord):
                self.bad_records.handle(record)  # raises under on_bad_record="fail"
                self.report.skipped_bad += 1
                continue
            if _is_blank(record) and not has_kind_fields(record, "chat"):
                # an empty chat goes on: it is a bad record (records.chat_messages), under the policy
                self.report.skipped_empty += 1
                continue
            self.report.records += 1
            yield origin, dict(record)

    def _decode(self, raw: bytes, origin: str) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            if self.decode_errors == "strict":
                raise ValueError(
                    f"{origin}: not valid UTF-8 ({err.reason} at byte {err.start}); re-encode it as UTF-8 "
                    "or pass decode_errors='replace' (--decode-errors replace)"
                ) from err
            self.report.decode_replaced += 1
            return raw.decode("utf-8", errors="replace")

    def _jsonl(self) -> Iterator[tuple[RecordOrigin, Any]]:
        """``(origin, record)``, or ``(origin, BadRecord)`` for a line that is not JSON."""
        with _open_binary(self.path) as f:
            for lineno, raw in enumerate(f, start=1):
                origin = RecordOrigin(self.path, line=lineno)
                if not raw.strip():
                    self.report.blank_lines += 1
                    continue
                if lineno == 1:
                    raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark (Windows editors)
                try:
                    # without its line break, so that an error at the end of the line names its column
                    record = json.loads(self._decode(raw.rstrip(b"\r\n"), origin))
                except json.JSONDecodeError as err:
                    record = BadRecord(origin, "malformed_json", f"malformed JSON: {err.msg} (column {err.colno})")
                yield origin, record

    def _json(self) -> Iterator[tuple[RecordOrigin, Any]]:
        # malformed JSON inside an array raises: the parser cannot find where the next element starts
        with _open_binary(self.path) as f:
            for index, line, record in iter_json_array(f, str(self.path), errors=self.decode_errors):
                yield RecordOrigin(self.path, record=index, line=line), record

    def _parquet(self) -> Iterator[tuple[RecordOrigin, Any]]:
        pq = require("pyarrow.parquet", "reading parquet files")
        try:
            parquet = pq.ParquetFile(self.path)
        except Exception as err:  # pyarrow raises ArrowInvalid / OSError subclasses
            raise ValueError(f"{self.path}: not a readable parquet file ({err})") from err
        row = 0
        for batch in parquet.iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                yield RecordOrigin(self.path, row=row), record
                row += 1

    def _hf(self) -> Iterator[tuple[RecordOrigin, Any]]:
        datasets = require("datasets", "reading a Hugging Face datasets folder (save_to_disk)")
        loaded = datasets.load_from_disk(str(self.path))
        split = self.config.split
        if isinstance(loaded, datasets.DatasetDict):
            names = list(loaded.keys())
            if split is None and len(names) == 1:
                split = names[0]
            if split not in loaded:
                raise ValueError(f"{self.path} holds the splits {names}; pass split= (--split) one of them")
            loaded = loaded[split]
        elif split is not None:
            raise ValueError(f"split={split!r} given, but {self.path} holds a single Dataset without splits")
        for row, record in enumerate(loaded.with_format(None)):
            yield RecordOrigin(self.path, row=row), record

    def _text(self) -> Iterator[tuple[RecordOrigin, Any]]:
        files = [self.path] if self.path.is_file() else list(self._walk_files())
        for file in files:
            rel = file.name if file == self.path else file.relative_to(self.path).as_posix()
            try:
                raw = file.read_bytes()
            except OSError as err:
                raise ValueError(f"{file}: cannot read it ({err.strerror})") from err
            text = self._decode(raw, str(file))
            if not text.strip():  # the record would not be blank: it carries its path
                self.report.skipped_empty += 1
                continue
            yield RecordOrigin(file), {"text": text, "path": rel}

    def _walk_files(self) -> Iterator[Path]:
        stdlib = self.format == "stdlib"
        suffixes = (".py",) if stdlib else self.config.text_suffixes
        for folder, dirnames, filenames in os.walk(self.path):
            # os.walk visits sub-folders in the order left in dirnames: sort for a stable corpus order
            dirnames[:] = sorted(
                d for d in dirnames if not d.startswith(".") and not (stdlib and d in _SKIPPED_STDLIB_DIRS)
            )
            for name in sorted(filenames):
                if name.startswith(".") or (suffixes is not None and not name.endswith(suffixes)):
                    continue
                yield Path(folder) / name


def _open_binary(path: Path) -> IO[bytes]:
    if path.suffix.lower() == ".gz":
        return gzip.open(path, "rb")
    return open(path, "rb")


def _is_blank(value: Any) -> bool:
    """True for values with nothing to learn from: blank strings, None, empty containers."""
    if isinstance(value, str):
        return not value.strip()
    if value is None:
        return True
    if isinstance(value, Mapping):
        return all(_is_blank(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_is_blank(v) for v in value)
    return False
