"""A state of plain values and numpy arrays on disk as JSON beside ``.npz``: never pickled, checksummed.

A data stream's state (``thdpack.packing.step_stream.StreamState.state_dict``) holds plain values
and, under ``"arrays"``, numpy arrays (the consumed pieces of an epoch: a bitmap over the
sequences and a few index arrays). ``write_state(path, state)`` writes:

- ``path`` (``.json``): ``{"state": the plain values, "arrays": {name: its sha256}, "sha256": ...}``,
  the last digest over the other two (compact JSON, sorted keys; without arrays the record is
  ``{"state", "sha256"}`` and the digest over the state alone), so a changed value or array is
  refused on reading;
- ``path`` with ``.npz`` (only when there are arrays): the arrays, read back with
  ``allow_pickle=False``.

Both are written atomically (temp file, fsync, rename), the arrays first: a reader that finds the
JSON finds the arrays it names. ``read_state(path)`` returns the state as it was given, or raises
``ValueError`` naming the file that is missing or damaged.

>>> import tempfile
>>> path = Path(tempfile.mkdtemp()) / "stream.json"
>>> _ = write_state(path, {"epoch": 2, "arrays": {"consumed.whole": np.array([3], dtype=np.uint8)}})
>>> state = read_state(path)
>>> state["epoch"], state["arrays"]["consumed.whole"].tolist()
(2, [3])
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from thdpack.files.publish import write_json_atomic

ARRAYS = "arrays"
"""The key of a state whose value maps names to numpy arrays."""


def arrays_path(path: Path) -> Path:
    """The ``.npz`` beside the JSON ``path``."""
    return path.with_suffix(".npz")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _array_sha256(array: np.ndarray) -> str:
    header = json.dumps([str(array.dtype), list(array.shape)]).encode()
    return _sha256(header + np.ascontiguousarray(array).tobytes())


def _record_sha256(plain: Mapping[str, Any], arrays: Mapping[str, str]) -> str:
    covered = {"state": plain, "arrays": arrays} if arrays else plain
    return _sha256(json.dumps(covered, sort_keys=True).encode())


def write_state(path: Path, state: Mapping[str, Any]) -> Path:
    """Write ``state`` (module docstring) to ``path`` and, with arrays, its ``.npz``; returns ``path``."""
    plain = {key: value for key, value in state.items() if key != ARRAYS}
    arrays = {name: np.asarray(value) for name, value in state.get(ARRAYS, {}).items()}
    digests = {name: _array_sha256(array) for name, array in arrays.items()}
    if arrays:
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        temp = arrays_path(path).with_name(f".{arrays_path(path).name}.tmp")
        with temp.open("wb") as f:
            f.write(buffer.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, arrays_path(path))
    record = {"state": plain, **({"arrays": digests} if digests else {}), "sha256": _record_sha256(plain, digests)}
    write_json_atomic(path, record)
    return path


def read_state(path: Path) -> dict[str, Any]:
    """The state ``write_state`` wrote to ``path``; ``ValueError`` naming the file when it is missing,
    damaged, or holds anything but plain values and arrays."""
    if not path.is_file():
        raise ValueError(f"{path} is missing")
    try:
        record = json.loads(path.read_text())
        plain, digests = record["state"], record.get("arrays", {})
        intact = record["sha256"] == _record_sha256(plain, digests)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is damaged ({type(err).__name__}: {err})") from None
    if not intact:
        raise ValueError(f"{path} is damaged (its checksum does not match)")
    if not digests:
        return dict(plain)
    npz = arrays_path(path)
    try:
        with np.load(npz, allow_pickle=False) as data:
            arrays = {name: data[name] for name in digests}
    except FileNotFoundError:
        raise ValueError(f"{npz} is missing (the arrays {path.name} names)") from None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
        raise ValueError(f"{npz} is damaged ({type(err).__name__}: {err})") from None
    bad = [name for name, array in arrays.items() if _array_sha256(array) != digests[name]]
    if bad:
        raise ValueError(f"{npz} is damaged ({', '.join(bad)} do not match their sha256 in {path.name})")
    return {**plain, ARRAYS: arrays}
