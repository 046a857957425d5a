"""The run's data: a cached token store (the steps cut from its packs are
:class:`thdpack.packing.steps.StepStream`'s)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np

from thdpack import __version__
from thdpack.data.encode import TokenizeConfig
from thdpack.data.manifest import StoreError
from thdpack.data.sources import SourceConfig
from thdpack.data.store import TokenStore
from thdpack.data.store_verify import verify_store
from thdpack.data.write_store import write_token_store
from thdpack.train.config import DataConfig

log = logging.getLogger(__name__)


# the files of a tokenizer folder that decide the tokens (vocabulary, EOS, chat template)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _file_key(path: Path) -> str:
    stat = path.stat() if path.exists() else None
    return f"{path}:{stat.st_size if stat else '-'}:{stat.st_mtime_ns if stat else '-'}"


def store_fingerprint(data: DataConfig) -> str:
    """A short hash of everything that decides the token store's content."""
    inputs = []
    for spec in data.inputs:
        if spec == "stdlib":
            inputs.append(f"stdlib:{sys.version_info[:3]}:{sysconfig.get_paths()['stdlib']}")
        else:
            inputs.append(_file_key(Path(spec).expanduser().resolve()))
    tokenizer = Path(data.tokenizer).expanduser().resolve()
    tokenizer_files = [_file_key(tokenizer / name) for name in _TOKENIZER_FILES] if tokenizer.is_dir() else []
    key = {
        "inputs": inputs,
        "tokenizer": data.tokenizer,
        "tokenizer_files": tokenizer_files,
        "format": data.format,
        "kind": data.kind,
        "chat_template": data.chat_template,
        "on_bad_record": data.on_bad_record,
        "limit": data.limit,
        "thdpack": __version__,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def cache_path(data: DataConfig) -> Path:
    """The cached store's folder for ``data`` (one per fingerprint)."""
    name = Path(data.inputs[0]).stem if data.inputs[0] != "stdlib" else "stdlib"
    return Path(data.cache_dir).expanduser() / f"{name}-{data.tokenizer.replace('/', '_')}-{store_fingerprint(data)}"


def open_token_store(data: DataConfig, *, vocab_size: int, is_local_main: bool, barrier: Any) -> TokenStore:
    """The run's token store, read in full before the first step by the local main rank: every
    file against its checksums, every token id below ``vocab_size`` (the model's).

    ``data.store`` set: that folder (written by ``thdpack prepare``) as it is; damage is a
    ``StoreError`` naming the file. Otherwise the cache in ``data.cache_dir``, tokenized once per
    machine: the local main rank builds it into a temporary folder and renames it into place
    (atomic on one file system) while the other ranks wait at ``barrier``; a damaged cache (a file
    deleted, cut short or changed, or written before checksums) is rebuilt with a warning naming
    the file.
    """
    if data.store is not None:
        path = Path(data.store).expanduser()
        if is_local_main:
            print(verify_store(path, vocab_size=vocab_size), flush=True)
        barrier()
        return TokenStore(path)
    path = cache_path(data)
    if is_local_main:
        _ensure_cache(data, path, vocab_size)
    barrier()
    try:
        return TokenStore(path)
    except StoreError as err:  # changed between the local main rank's check and this rank's open
        raise StoreError(err.file, err.problem, "the token cache changed while the run started; run again") from err


def _ensure_cache(data: DataConfig, path: Path, vocab_size: int) -> None:
    damage = _cache_damage(path, vocab_size)
    if damage is None:
        return
    if path.exists():
        # the fix StoreError suggests is for prepared stores: a cache repairs itself
        log.warning("token cache %s is damaged: %s %s; rebuilding it", path, damage.file, damage.problem)
    print(f"tokenizing {', '.join(data.inputs)} with {data.tokenizer} into {path} (once; cached)", flush=True)
    _build_cache(data, path, damaged=path.exists())
    damage = _cache_damage(path, vocab_size)
    if damage is not None:
        raise StoreError(
            damage.file,
            f"{damage.problem}, right after the token cache was rebuilt",
            f"check the disk that holds data.cache_dir={data.cache_dir}, or set data.cache_dir to another folder",
        )


def _cache_damage(path: Path, vocab_size: int) -> StoreError | None:
    """None when the cache at ``path`` is intact (it says so), else what is wrong with it."""
    try:
        print(verify_store(path, vocab_size=vocab_size, require_checksums=True), flush=True)
    except StoreError as err:
        return err
    return None


def _build_cache(data: DataConfig, path: Path, *, damaged: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    write_token_store(
        data.inputs,
        tmp,
        tokenizer=data.tokenizer,
        source_config=SourceConfig(format=data.format),
        tokenize_config=TokenizeConfig(
            kind=data.kind,
            chat_template=data.chat_template,
            on_bad_record=data.on_bad_record,
        ),
        limit=data.limit,
        overwrite=True,
    )
    if damaged:
        # move the damaged folder out of the way (a rename: a reader never sees half of it); when
        # another machine sharing the cache already did, or installed a new one, there is nothing here
        aside = path.with_name(f"{path.name}.damaged-{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            path.rename(aside)
        shutil.rmtree(aside, ignore_errors=True)
    try:
        tmp.rename(path)
    except OSError:  # another machine sharing the cache installed one first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)


def pad_id_of(store: TokenStore) -> int:
    """The padding token: the tokenizer's EOS when the store knows it (its label is -100 anyway)."""
    eos = store.manifest.get("tokenizer", {}).get("eos_id")
    return int(eos) if eos is not None else 0


def real_lengths_summary(lengths: np.ndarray) -> str:
    return (
        f"{len(lengths):,} samples, {int(lengths.sum()):,} tokens, lengths min {int(lengths.min()):,} / "
        f"median {int(np.median(lengths)):,} / max {int(lengths.max()):,}"
    )
