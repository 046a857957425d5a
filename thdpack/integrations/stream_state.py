"""The pack stream's state in a Trainer checkpoint folder: ``thdpack_stream.json``, checksummed.

A damaged or missing file is refused on resume: the stream's position would be unknown, and a
run resumed elsewhere would silently train on other packs than the uninterrupted one.

>>> import tempfile
>>> folder = Path(tempfile.mkdtemp())
>>> _ = write_stream_state(folder, {"steps_done": 2, "stream": {"epoch": 0, "position": 4}})
>>> read_stream_state(folder)["steps_done"]
2
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from thdpack.files.publish import write_json_atomic

STATE_FILE = "thdpack_stream.json"
"""The pack stream's state in each Trainer checkpoint folder."""


def write_stream_state(folder: Path, state: Mapping[str, Any]) -> Path:
    """``folder/STATE_FILE``: ``{"state": state, "sha256": its digest}``, written atomically (fsync, rename)."""
    path = folder / STATE_FILE
    write_json_atomic(path, {"state": state, "sha256": _state_sha256(state)})
    return path


def _state_sha256(state: Mapping[str, Any]) -> str:
    """The digest of ``state`` as compact JSON with sorted keys: the record's layout (indentation)
    may change without changing it."""
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


def read_stream_state(folder: Path) -> dict[str, Any]:
    """The stream state saved in a checkpoint folder; ``ValueError`` when it is missing or damaged."""
    path = folder / STATE_FILE
    if not path.is_file():
        raise ValueError(
            f"{folder} has no {STATE_FILE}: it was not written by thdpack's trainer, so the pack stream's position "
            "is unknown; resume from a checkpoint of this trainer"
        )
    try:
        record = json.loads(path.read_text())
        state = record["state"]
        ok = _state_sha256(state) == record["sha256"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is damaged ({err}); resume from another checkpoint") from err
    if not ok:
        raise ValueError(f"{path} is damaged (its checksum does not match); resume from another checkpoint")
    return state
