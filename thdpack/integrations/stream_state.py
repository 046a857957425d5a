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
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

STATE_FILE = "thdpack_stream.json"
"""The pack stream's state in each Trainer checkpoint folder."""


def write_stream_state(folder: Path, state: Mapping[str, Any]) -> Path:
    """``folder/STATE_FILE``: ``state`` with its sha256, written atomically."""
    payload = json.dumps(state, sort_keys=True)
    record = {"state": state, "sha256": hashlib.sha256(payload.encode()).hexdigest()}
    path = folder / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path


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
        ok = hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest() == record["sha256"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is damaged ({err}); resume from another checkpoint") from err
    if not ok:
        raise ValueError(f"{path} is damaged (its checksum does not match); resume from another checkpoint")
    return state
