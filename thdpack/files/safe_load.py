"""Reading back what thdpack saved without running code from it.

Unpickling calls whatever a pickle names, so a crafted file (a checkpoint in a shared
output_dir, its checksums recomputed) would run code on resume: checksums catch accidents, this
catches intent. Every file thdpack loads goes through ``load_plain`` (``torch.load(weights_only
=True)``: tensors and plain values), ``load_array`` (``np.load(allow_pickle=False)``) or
``thdpack.files.safe_dcp.load_dcp``; a refused file raises ``UnsafeFileError`` naming it.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np


class UnsafeFileError(ValueError):
    """A file thdpack refused to load because it asks to run code or build objects it does not allow."""

    def __init__(self, path: Path | str, asked: str) -> None:
        self.path = path
        super().__init__(
            f"{path} is refused: it asks for {asked}, and thdpack loads only tensors and plain values, never "
            "code, from a file; it was crafted, or written by other software or an older thdpack; replace it "
            "with a file thdpack wrote (or start over without it)"
        )


def load_plain(path: str | os.PathLike[str]) -> Any:
    """``torch.load(path)`` of tensors and plain values only (on the CPU); ``UnsafeFileError`` naming
    ``path`` and the global it names when it holds anything else."""
    import torch  # here, not above: the stats command reads .npy lengths without importing torch

    path = Path(path)
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        raise UnsafeFileError(path, refused_global(err)) from None


def load_array(path: str | os.PathLike[str]) -> np.ndarray:
    """The array in the ``.npy`` file ``path``, never unpickled; ``ValueError`` naming ``path`` when it
    holds Python objects or is no ``.npy`` file."""
    path = Path(path)
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as err:
        what = "Python objects (an object array)" if "Object arrays" in str(err) else "no .npy array"
        raise ValueError(
            f"{path} holds {what}, and thdpack never unpickles a file; save a plain numeric array "
            "(np.save(path, values.astype(np.int64)))"
        ) from None


def refused_global(err: pickle.UnpicklingError) -> str:
    """The global a refused weights-only load named, from torch's message ("Unsupported global: GLOBAL os.system
    was not an allowed global by default ...")."""
    text = str(err)
    marker = "GLOBAL "
    start = text.find(marker)
    if start < 0:
        return "an object that is not a tensor or a plain value"
    name = text[start + len(marker) :].split()[0]
    return f"the global {name}"
