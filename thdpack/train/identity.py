"""What a checkpoint was trained on and with, recorded when it is saved and compared on resume.

The identity in every checkpoint's ``trainer.pt`` holds the data (the sha256 of each token-store
file), the tokenizer and the model's settings (a ``model.path`` folder by its ``config.json``'s
sha256). Resume compares them before it loads any weight: another model is refused, other data or
another tokenizer too unless ``train.resume_data_changed=true`` (docs/guides/operations.md,
"Resume checks what it continues").

>>> saved = {"data": {"origin": "a", "files": {"tokens.bin": "11"}}, "tokenizer": {"sha256": "t"}, "model": {"dim": 32}}
>>> mine = {"data": {"origin": "b", "files": {"tokens.bin": "22"}}, "tokenizer": {"sha256": "t"}, "model": {"dim": 64}}
>>> identity_differences(saved, mine)
{'data': ['tokens.bin: sha256 11 (checkpoint), 22 (this run)'], 'model': ['dim: checkpoint 32, this run 64']}
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from thdpack.data.manifest import content_files, has_checksums
from thdpack.data.store import TokenStore

log = logging.getLogger(__name__)
_NOT_MODEL = ("attention",)
"""Model-group fields that are not the model's identity (the attention backend may change on resume)."""


def run_identity(cfg: Any, store: TokenStore) -> dict[str, Any]:
    """The identity of the run ``cfg`` (a ``thdpack.train.config.Config``) training on ``store``."""
    manifest = store.manifest
    if has_checksums(manifest):
        files = {name: manifest["checksums"][name]["sha256"] for name in content_files(manifest)}
    else:  # a store written before checksums: its sizes are all there is
        files = {name: f"{(store.path / name).stat().st_size} bytes" for name in content_files(manifest)}
    if cfg.data.store is not None:
        origin = f"data.store={cfg.data.store}"
    else:
        origin = f"data.inputs=[{', '.join(cfg.data.inputs)}] (token cache {store.path})"
    tokenizer = manifest["tokenizer"]
    return {
        "data": {"origin": origin, "files": files},
        "tokenizer": {key: tokenizer.get(key) for key in ("name", "sha256", "vocab_size")},
        "model": model_identity(asdict(cfg.model)),
    }


def model_identity(model: Mapping[str, Any]) -> dict[str, Any]:
    """The model group's settings that define the model (``path`` replaced by its config's digest)."""
    out = {key: value for key, value in model.items() if key not in _NOT_MODEL}
    path = out.pop("path", None)
    if path is not None:
        config = Path(os.path.expanduser(path)) / "config.json"
        digest = hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else f"{config} (missing)"
        out["path's config.json"] = digest
    return out


def identity_differences(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> dict[str, list[str]]:
    """``{"data" | "tokenizer" | "model": [what differs, ...]}`` for every part that differs."""
    out: dict[str, list[str]] = {}
    data = _files_differ(saved["data"]["files"], mine["data"]["files"])
    if data:
        out["data"] = data
    tokenizer = saved["tokenizer"], mine["tokenizer"]
    if tokenizer[0].get("sha256") != tokenizer[1].get("sha256"):
        out["tokenizer"] = [
            f"checkpoint {_tokenizer(tokenizer[0])}, this run {_tokenizer(tokenizer[1])}",
        ]
    model = _settings_differ(saved["model"], mine["model"])
    if model:
        out["model"] = model
    return out


def _files_differ(saved: Mapping[str, str], mine: Mapping[str, str]) -> list[str]:
    return [
        f"{name}: sha256 {_short(saved.get(name))} (checkpoint), {_short(mine.get(name))} (this run)"
        for name in sorted(set(saved) | set(mine))
        if saved.get(name) != mine.get(name)
    ]


def _short(digest: str | None) -> str:
    return "absent" if digest is None else digest[:12] + "..." if len(digest) == 64 else digest


def _settings_differ(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> list[str]:
    names = [*saved, *(k for k in mine if k not in saved)]
    if saved.get("kind") != mine.get("kind"):  # another kind of model: its sizes say nothing more
        names = ["kind"]
    return [
        f"{name}: checkpoint {saved.get(name)!r}, this run {mine.get(name)!r}"
        for name in names
        if saved.get(name) != mine.get(name)
    ]


def _tokenizer(entry: Mapping[str, Any]) -> str:
    return f"{entry.get('name')!r} (sha256 {_short(entry.get('sha256'))}, {entry.get('vocab_size')} ids)"


def check_resume_identity(
    trainer: Mapping[str, Any], mine: Mapping[str, Any], *, folder: Path, data_changed: bool
) -> bool:
    """Compare the checkpoint's identity (its ``trainer.pt`` contents ``trainer``) with the run's
    ``mine``; returns True when the data or tokenizer differ and ``data_changed`` allows it.

    ``ValueError`` naming every difference: always for the model; for the data and the tokenizer
    unless ``data_changed`` (``train.resume_data_changed``).
    """
    saved = trainer.get("identity")
    if saved is None:  # written before identities: the config it saved still names its model
        log.warning(
            "checkpoint %s records no data or tokenizer identity (an older thdpack wrote it): not compared", folder
        )
        saved = {
            "data": mine["data"],
            "tokenizer": mine["tokenizer"],
            "model": model_identity(trainer["config"]["model"]),
        }
    differences = identity_differences(saved, mine)
    if "model" in differences:
        raise ValueError(
            f"checkpoint {folder} holds another model than this run's ({'; '.join(differences['model'])}); resume "
            "with the model settings that made it (its config.yaml in train.output_dir), or start a new "
            "train.output_dir"
        )
    changed = [f"{part} ({'; '.join(differences[part])})" for part in ("data", "tokenizer") if part in differences]
    if not changed:
        return False
    if not data_changed:
        raise ValueError(
            f"checkpoint {folder} was trained on other data than this run's: {'; '.join(changed)}; it was trained "
            f"on {saved['data']['origin']}, this run reads {mine['data']['origin']}. Resume with the data it was "
            "trained on, or set train.resume_data_changed=true to continue its model on this data (the data "
            "stream then starts at this data's beginning)"
        )
    return True
