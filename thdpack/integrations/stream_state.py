"""The pack stream's state in a Trainer checkpoint folder: ``thdpack_stream.json`` (and, with the
consumed pieces of the epoch, ``thdpack_stream.npz``), checksummed (``thdpack.files.state_file``).

A damaged or missing file is refused on resume: the stream's position would be unknown, and a
run resumed elsewhere would silently train on other packs than the uninterrupted one.

>>> import tempfile
>>> folder = Path(tempfile.mkdtemp())
>>> _ = write_stream_state(folder, {"steps_done": 2, "stream": {"epoch": 0, "position": 4}})
>>> read_stream_state(folder)["steps_done"]
2
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from thdpack.files.state_file import read_state, write_state

STATE_FILE = "thdpack_stream.json"
"""The pack stream's state in each Trainer checkpoint folder."""


def write_stream_state(folder: Path, state: Mapping[str, Any]) -> Path:
    """``folder/STATE_FILE`` (and its ``.npz`` when ``state`` holds arrays), written atomically."""
    return write_state(folder / STATE_FILE, state)


def read_stream_state(folder: Path) -> dict[str, Any]:
    """The stream state saved in a checkpoint folder; ``ValueError`` when it is missing or damaged."""
    path = folder / STATE_FILE
    if not path.is_file():
        raise ValueError(
            f"{folder} has no {STATE_FILE}: it was not written by thdpack's trainer, so the pack stream's position "
            "is unknown; resume from a checkpoint of this trainer"
        )
    try:
        return read_state(path)
    except ValueError as err:
        raise ValueError(f"{err}; resume from another checkpoint") from None
