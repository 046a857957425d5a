"""The run's data: a cached token store (the steps cut from its packs are
:class:`thdpack.packing.steps.StepStream`'s)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np

from thdpack import __version__
from thdpack.data.encode import TokenizeConfig
from thdpack.data.manifest import MANIFEST_FILE, STORE_FILES, StoreError
from thdpack.data.prepared_plan import PLAN_FILE
from thdpack.data.sources import SourceConfig
from thdpack.data.store import TokenStore
from thdpack.data.store_verify import verify_store
from thdpack.data.tokenizer import load_tokenizer
from thdpack.data.write_store import SKIPPED_FILE, write_token_store
from thdpack.files.lock import FolderBusyError, FolderLock
from thdpack.models.config import ModelConfig
from thdpack.models.hf_causal_lm import HFModelConfig
from thdpack.models.hf_folder import folder_tokenizer
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
    ``StoreError`` naming the file. Otherwise the cache in ``data.cache_dir``, tokenized once: the
    local main rank builds it in place under the store's lock (a machine sharing the cache waits
    for the lock, then uses what the first built) while the other ranks wait at ``barrier``; it is
    published as every store is, manifest last (``thdpack.files.publish``). A damaged cache (a file
    deleted, cut short or changed, or written before checksums) is rebuilt with a warning naming
    the file. A build that fails removes its folder; one that succeeds then removes the folders
    that killed builds left unfinished in ``data.cache_dir`` (``remove_unfinished_caches``).
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
    if _cache_damage(path, vocab_size) is None:
        return
    # one builder at a time; a machine that shares data.cache_dir and comes second waits here, then
    # finds the cache the first one built
    with FolderLock(path, wait=True) as lock:
        damage = _cache_damage(path, vocab_size, lock=lock)
        if damage is None:
            return
        if path.exists():
            # the fix StoreError suggests is for prepared stores: a cache repairs itself
            log.warning("token cache %s is damaged: %s %s; rebuilding it", path, damage.file, damage.problem)
        print(f"tokenizing {', '.join(data.inputs)} with {data.tokenizer} into {path} (once; cached)", flush=True)
        try:
            _build_cache(data, path, lock)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)  # unfinished: a failed build leaves no folder behind
            raise
        damage = _cache_damage(path, vocab_size, lock=lock)
    if damage is None:
        remove_unfinished_caches(path.parent)  # what killed builds of other caches left
    else:
        raise StoreError(
            damage.file,
            f"{damage.problem}, right after the token cache was rebuilt",
            f"check the disk that holds data.cache_dir={data.cache_dir}, or set data.cache_dir to another folder",
        )


_CACHE_NAME = re.compile(r".+-[0-9a-f]{12}")
"""A cache folder's name (``cache_path``): ends in the store fingerprint."""
_UNFINISHED_FILES = frozenset({*STORE_FILES, SKIPPED_FILE, PLAN_FILE, f".{MANIFEST_FILE}.partial"})
"""What a store build writes before its manifest: a cache folder holding anything else is not
removed, whatever its name."""


def remove_unfinished_caches(cache_dir: Path) -> list[Path]:
    """Remove the cache folders in ``cache_dir`` that a killed build left unfinished (no manifest,
    nobody holding their lock), and the lock files of builders that died; return the folders removed.

    A build that fails with an exception removes its own folder; one that is killed (SIGKILL, a
    torchrun that stops its ranks, a lost node) cannot, and a cache with another fingerprint is
    never built again in its place. Each folder is taken under its lock first, so one being built
    (on this machine or another sharing ``cache_dir``) is left alone.
    """
    removed: list[Path] = []
    if not cache_dir.is_dir():
        return removed
    for entry in sorted(cache_dir.iterdir()):
        lock_of = entry.name.startswith(".") and entry.name.endswith(".lock")
        folder = entry.with_name(entry.name[1 : -len(".lock")]) if lock_of else entry
        if not _CACHE_NAME.fullmatch(folder.name) or (lock_of and folder.exists()):
            continue  # a lock file beside a folder goes with the folder
        if not lock_of and not _unfinished(folder):
            continue
        try:
            lock = FolderLock(folder).acquire()
        except FolderBusyError:
            continue  # being built now
        try:
            if folder.exists() and _unfinished(folder):
                shutil.rmtree(folder)
                removed.append(folder)
                print(f"removed {folder}: a token cache that a killed build left unfinished", flush=True)
        finally:
            lock.release()  # and with it the lock file
    return removed


def _unfinished(folder: Path) -> bool:
    try:
        if not folder.is_dir() or (folder / MANIFEST_FILE).exists():
            return False
        return all(child.name in _UNFINISHED_FILES and child.is_file() for child in folder.iterdir())
    except FileNotFoundError:  # removed meanwhile by another process's clean-up
        return False


def _cache_damage(path: Path, vocab_size: int, lock: FolderLock | None = None) -> StoreError | None:
    """None when the cache at ``path`` is intact (it says so), else what is wrong with it (a cache
    that another process is writing is a ``StoreBusyError``)."""
    try:
        print(verify_store(path, vocab_size=vocab_size, require_checksums=True, lock=lock), flush=True)
    except StoreError as err:
        return err
    return None


def _build_cache(data: DataConfig, path: Path, lock: FolderLock) -> None:
    """Write the store in place, published as every store is (``thdpack.files.publish``): the old
    manifest goes first, the new one comes last, so the folder is unfinished in between."""
    write_token_store(
        data.inputs,
        path,
        tokenizer=data.tokenizer,
        source_config=SourceConfig(format=data.format),
        tokenize_config=TokenizeConfig(
            kind=data.kind,
            chat_template=data.chat_template,
            on_bad_record=data.on_bad_record,
        ),
        limit=data.limit,
        overwrite=True,
        lock=lock,
    )


def check_model_tokenizer(model: ModelConfig | HFModelConfig, store: TokenStore) -> str | None:
    """Refuse a store tokenized with another tokenizer than the one the model's folder ships.

    Only a ``model=hf`` folder with a tokenizer is checked (thdpack's own model and a random
    initialisation have none): its vocabulary's digest (``TextTokenizer.vocab_sha256``) must be
    the one the store's manifest records, else ``ValueError`` naming both (the vocabulary sizes
    alone agree for many pairs, and the model would read the store's ids as other tokens).
    Returns a warning when it cannot tell: a store written before the digest was recorded (unless
    its tokenizer file is the folder's, byte for byte), or a folder whose tokenizer has no
    ``tokenizer.json``.
    """
    if not isinstance(model, HFModelConfig) or model.path is None:
        return None
    folder = folder_tokenizer(model.path)
    if folder is None:
        return None
    if not (folder / "tokenizer.json").is_file():
        return (
            f"model.path={model.path} ships a tokenizer without tokenizer.json, which thdpack cannot read: it cannot "
            f"check that {store.path} was tokenized with it"
        )
    recorded = store.manifest["tokenizer"]
    theirs = load_tokenizer(folder)
    if recorded.get("vocab_sha256") is None:
        if recorded.get("sha256") == theirs.sha256:
            return None  # the same tokenizer.json, byte for byte
        return (
            f"{store.path} records no vocabulary digest (written before thdpack recorded one), so it cannot be "
            f"checked against the tokenizer of model.path={model.path}; prepare it again to check "
            f"(thdpack prepare ... --tokenizer {model.path} --overwrite)"
        )
    if recorded["vocab_sha256"] == theirs.vocab_sha256:
        return None
    raise ValueError(
        f"{store.path} was tokenized with {recorded.get('name')!r} ({recorded['vocab_size']:,} ids, vocabulary "
        f"sha256 {recorded['vocab_sha256'][:12]}) but model.path={model.path} ships another tokenizer "
        f"({theirs.vocab_size:,} ids, vocabulary sha256 {theirs.vocab_sha256[:12]}): the model would read the "
        f"store's ids as other tokens; tokenize the data with the model's tokenizer (data.tokenizer={model.path}, "
        f"or thdpack prepare ... --tokenizer {model.path})"
    )


def pad_id_of(store: TokenStore) -> int:
    """The padding token: the tokenizer's EOS when the store knows it (its label is -100 anyway)."""
    eos = store.manifest.get("tokenizer", {}).get("eos_id")
    return int(eos) if eos is not None else 0


def real_lengths_summary(lengths: np.ndarray) -> str:
    return (
        f"{len(lengths):,} samples, {int(lengths.sum()):,} tokens, lengths min {int(lengths.min()):,} / "
        f"median {int(np.median(lengths)):,} / max {int(lengths.max()):,}"
    )
