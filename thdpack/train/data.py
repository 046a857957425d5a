"""The run's data: a cached token store (the steps cut from its packs are
:class:`thdpack.packing.steps.StepStream`'s)."""

from __future__ import annotations

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
from thdpack.data.prepare import write_token_store
from thdpack.data.sources import SourceConfig
from thdpack.data.store import TokenStore
from thdpack.data.tokenize import TokenizeConfig
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


def open_token_store(data: DataConfig, *, is_local_main: bool, barrier: Any) -> TokenStore:
    """The run's token store, tokenized once per machine and cached in ``data.cache_dir``.

    The local main rank builds it into a temporary folder and renames it into place (atomic on
    one file system), while the other ranks wait at ``barrier``.
    """
    name = Path(data.inputs[0]).stem if data.inputs[0] != "stdlib" else "stdlib"
    path = Path(data.cache_dir).expanduser() / f"{name}-{data.tokenizer.replace('/', '_')}-{store_fingerprint(data)}"
    if is_local_main and not (path / "manifest.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        print(f"tokenizing {', '.join(data.inputs)} with {data.tokenizer} into {path} (once; cached)", flush=True)
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
        try:
            tmp.rename(path)
        except OSError:  # another machine sharing the cache finished first
            shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    return TokenStore(path)


def pad_id_of(store: TokenStore) -> int:
    """The padding token: the tokenizer's EOS when the store knows it (its label is -100 anyway)."""
    eos = store.manifest.get("tokenizer", {}).get("eos_id")
    return int(eos) if eos is not None else 0


def real_lengths_summary(lengths: np.ndarray) -> str:
    return (
        f"{len(lengths):,} samples, {int(lengths.sum()):,} tokens, lengths min {int(lengths.min()):,} / "
        f"median {int(np.median(lengths)):,} / max {int(lengths.max()):,}"
    )
