"""The settings a saved state was made with, and the one check that they still hold on resume.

Every resumable object here (``PackedDataset``, ``StreamingPacker``, ``StepStream``) saves the
settings that define what it yields (its config's ``fingerprint()`` and the run's values that
shape it, such as the CP size); loading a state made with other settings would silently
yield other packs, so it raises, naming every setting that differs.

>>> saved = {"pack_size": 1024, "seed": 0}
>>> check_saved_settings("PackedDataset", saved, {"pack_size": 2048, "seed": 0})
Traceback (most recent call last):
...
ValueError: state was saved by a PackedDataset with other settings (pack_size: saved 1024, now 2048); ...
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def check_saved_settings(kind: str, saved: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming each setting of ``mine`` that ``saved`` has otherwise."""
    diff = {key: (saved.get(key), value) for key, value in mine.items() if saved.get(key) != value}
    if diff:
        shown = ", ".join(f"{key}: saved {a!r}, now {b!r}" for key, (a, b) in diff.items())
        raise ValueError(
            f"state was saved by a {kind} with other settings ({shown}); resume with the settings that made it"
        )
