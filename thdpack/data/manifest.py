"""A token store's ``manifest.json``: its fields, their checks, and ``StoreError``.

Besides the counts and the tokenizer (``tokenizer.vocab_sha256``: the vocabulary's digest, which
lets a run check its model's tokenizer), a manifest records ``checksums`` (every file's size and
sha256) and the range of ``token_ids``. Manifests without checksums (format version 1) still
open: ``verify_store`` checks their structure and warns that a changed byte cannot be detected.
Every problem is a ``StoreError`` (a ``ValueError``) naming the file, what is wrong and what to do.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from thdpack.data.encode import SAMPLE_FORMATS
from thdpack.files.publish import write_json_atomic

STORE_FORMAT = "thdpack-token-store"
STORE_VERSION = 2
LEGACY_VERSIONS = (1,)
"""Versions that open without checksums (structure and token ids checked, with a warning)."""
TOKENS_FILE = "tokens.bin"
OFFSETS_FILE = "offsets.npy"
LOSS_MASK_FILE = "loss_mask.bin"
MANIFEST_FILE = "manifest.json"
STORE_FILES = (TOKENS_FILE, OFFSETS_FILE, LOSS_MASK_FILE, MANIFEST_FILE)
TOKEN_DTYPES = ("uint16", "int32")

# field -> accepted JSON types; bool is checked apart (JSON true is not a count)
_FIELDS: dict[str, type] = {
    "format": str,
    "version": int,
    "tokenizer": dict,
    "dtype": str,
    "sample_format": str,
    "num_samples": int,
    "num_tokens": int,
    "has_loss_mask": bool,
}
_FIELDS_V2: dict[str, type] = {"checksums": dict, "token_ids": dict}
_SHA256 = re.compile(r"[0-9a-f]{64}")


def rewrite_fix(folder: Path) -> str:
    """What to do about a damaged store that a person prepared."""
    return f"the store is damaged: write it again with `thdpack prepare ... --out {folder} --overwrite`"


class StoreError(ValueError):
    """A token store that is missing, unfinished or damaged; ``str()`` joins the three arguments.

    Args:
        file: the offending file.
        problem: what is wrong with it, a predicate (e.g. "has 10 bytes, manifest.json says 18").
        fix: what to do; None: rewrite the store (``thdpack prepare ... --overwrite``).
    """

    def __init__(self, file: str | os.PathLike[str], problem: str, fix: str | None = None) -> None:
        self.file = Path(file)
        self.problem = problem
        self.fix = rewrite_fix(self.file.parent) if fix is None else fix
        super().__init__(f"{self.file} {problem}; {self.fix}")

    def __reduce__(self) -> tuple[Any, ...]:  # the default would call __init__ with the message only
        return type(self), (self.file, self.problem, self.fix)


class StoreBusyError(StoreError):
    """Another process holds the store folder's lock: it is writing the store now."""


def content_files(manifest: Mapping[str, Any]) -> list[str]:
    """The data files a store holds (its manifest aside): tokens, offsets and, for SFT, the mask."""
    return [TOKENS_FILE, OFFSETS_FILE, *([LOSS_MASK_FILE] if manifest["has_loss_mask"] else [])]


def has_checksums(manifest: Mapping[str, Any]) -> bool:
    return manifest["version"] not in LEGACY_VERSIONS


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checked manifest of a store folder.

    Args:
        path: the store folder.

    Returns:
        ``manifest.json`` as a dict, its fields checked; a ``StoreError`` names a bad field.
    """
    folder = Path(path)
    file = folder / MANIFEST_FILE
    if not file.is_file():
        raise StoreError(
            file,
            f"is missing: {folder} holds no finished token store",
            f"run `thdpack prepare ... --out {folder}` first (a prepare that was interrupted leaves no manifest)",
        )
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise StoreError(file, f"is not valid JSON (cut short or overwritten: {err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != STORE_FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise StoreError(
            file,
            f"is not a {STORE_FORMAT} manifest (format={got!r})",
            "point at a folder written by `thdpack prepare` (or TokenStoreWriter)",
        )
    version = manifest.get("version")
    if version != STORE_VERSION and version not in LEGACY_VERSIONS:
        raise StoreError(
            file,
            f"has version {version!r}; this thdpack reads versions {[*LEGACY_VERSIONS, STORE_VERSION]}",
            "upgrade thdpack to read it, or prepare the store again with this one",
        )
    fields = _FIELDS if version in LEGACY_VERSIONS else {**_FIELDS, **_FIELDS_V2}
    for name, kind in fields.items():
        _check_field(file, manifest, name, kind)
    _check_values(file, manifest)
    return manifest


def _check_field(file: Path, manifest: Mapping[str, Any], name: str, kind: type) -> None:
    if name not in manifest:
        raise StoreError(file, f"has no {name!r} field")
    value = manifest[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise StoreError(file, f"has {name}={value!r}, not a JSON {_JSON_NAMES[kind]}")


_JSON_NAMES = {str: "string", int: "integer", dict: "object", bool: "boolean"}


def _check_values(file: Path, manifest: Mapping[str, Any]) -> None:
    if manifest["dtype"] not in TOKEN_DTYPES:
        raise StoreError(file, f"has dtype={manifest['dtype']!r}, not one of {list(TOKEN_DTYPES)}")
    if manifest["sample_format"] not in SAMPLE_FORMATS:
        raise StoreError(file, f"has sample_format={manifest['sample_format']!r}, not one of {list(SAMPLE_FORMATS)}")
    for name in ("num_samples", "num_tokens"):
        if manifest[name] < 0:
            raise StoreError(file, f"has {name}={manifest[name]}, below 0")
    vocab = manifest["tokenizer"].get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise StoreError(file, f"has tokenizer.vocab_size={vocab!r}, not a positive integer")
    if not has_checksums(manifest):
        return
    for name in content_files(manifest):
        entry = manifest["checksums"].get(name)
        valid = (
            isinstance(entry, dict)
            and isinstance(entry.get("size"), int)
            and isinstance(entry.get("sha256"), str)
            and _SHA256.fullmatch(entry["sha256"])
        )
        if not valid:
            raise StoreError(file, f"has checksums[{name!r}]={entry!r}, not {{'size': bytes, 'sha256': 64 hex digits}}")
    for end in ("min", "max"):
        value = manifest["token_ids"].get(end, "absent")
        if not (value is None or (isinstance(value, int) and not isinstance(value, bool))):
            raise StoreError(file, f"has token_ids[{end!r}]={value!r}, not an integer or null")


def write_manifest(path: str | os.PathLike[str], manifest: Mapping[str, Any]) -> None:
    """Write ``manifest.json`` atomically (a reader sees the old or the new file, never half)."""
    write_json_atomic(Path(path) / MANIFEST_FILE, manifest)
