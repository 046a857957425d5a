"""A THD batch's ``cu_seqlens`` tensors: host lengths from them (checked), them from lengths, and
which ones a record describes.

Legend: ``S`` sequences.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

CU_KEYS = ("cu_seqlens", "cu_seqlens_padded")


def cu_lengths(name: str, cu: Any) -> np.ndarray:
    """(S,) int64 lengths of a ``cu_seqlens``-style tensor, checked: an integer (S+1,) tensor with
    ``[0] == 0`` that never decreases. Copies it to the host (one sync on an accelerator)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (int32), got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with at least 2 entries (S+1), got shape {tuple(cu.shape)}")
    host = cu.detach().cpu().numpy().astype(np.int64)
    if host[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {host[0]}")
    lengths = np.diff(host)
    drops = lengths < 0
    if drops.any():
        i = int(np.argmax(drops)) + 1
        raise ValueError(f"{name} must be non-decreasing; it drops at entry {i} ({host[i - 1]} -> {host[i]})")
    return lengths


def cu_from_lengths(lengths_S: Sequence[int] | np.ndarray, device: torch.device | str = "cpu") -> torch.Tensor:
    """(S+1,) int32 ``[0] + cumsum(lengths)`` on ``device``: the inverse of :func:`cu_lengths`.

    >>> cu_from_lengths([3, 4, 1]).tolist()
    [0, 3, 7, 8]
    """
    lengths = np.asarray(lengths_S, dtype=np.int64)
    cu = np.empty(len(lengths) + 1, dtype=np.int32)
    cu[0] = 0
    cu[1:] = lengths.cumsum()  # int64 sums, cast once (faster than cumsum into an int32 out)
    return torch.from_numpy(cu).to(device)


class CuTensors(NamedTuple):
    """The ``cu`` tensors a record describes, and their ``_version`` when it was attached to them
    (an in-place change bumps it)."""

    cu_seqlens: torch.Tensor
    cu_version: int
    cu_seqlens_padded: torch.Tensor | None
    padded_version: int

    @classmethod
    def of(cls, thd: Mapping[str, Any]) -> CuTensors:
        """The ``cu`` tensors ``thd`` holds now."""
        cu_seqlens, padded = thd["cu_seqlens"], thd.get("cu_seqlens_padded")
        return cls(cu_seqlens, cu_seqlens._version, padded, 0 if padded is None else padded._version)

    def held_by(self, thd: Mapping[str, Any]) -> bool:
        """``thd`` holds these very tensors (changed or not)."""
        return thd.get("cu_seqlens") is self.cu_seqlens and thd.get("cu_seqlens_padded") is self.cu_seqlens_padded

    def unchanged_in(self, thd: Mapping[str, Any]) -> bool:
        """``thd`` holds these very tensors, unchanged since. Reads no tensor."""
        if not self.held_by(thd) or self.cu_seqlens._version != self.cu_version:
            return False
        return self.cu_seqlens_padded is None or self.cu_seqlens_padded._version == self.padded_version
