"""CP slot math: how many pack slots a sequence takes under context parallelism.

Transformer Engine cuts every sequence into ``2*cp_size`` equal chunks, so under CP
(``cp_size > 1``) a sequence of length ``n`` occupies ``ceil(n / (2*cp_size)) * 2*cp_size``
slots, and a pack's size must be a multiple of ``2*cp_size``. The planners size their bins with
these rules and the packer lays tokens out by them (``thdpack.packing.layout``). Numpy only.
"""

from __future__ import annotations

import numpy as np


def cp_multiple(cp_size: int) -> int:
    """Every sequence's padded length is a multiple of this: ``2*cp_size`` under CP, else 1.

    >>> cp_multiple(1), cp_multiple(2), cp_multiple(4)
    (1, 4, 8)
    """
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    return 2 * cp_size if cp_size > 1 else 1


def check_pack_size(pack_size: int, cp_size: int) -> None:
    """Raise ``ValueError`` unless ``pack_size >= 1`` is a multiple of ``cp_multiple(cp_size)``."""
    if pack_size < 1:
        raise ValueError(f"pack_size must be >= 1, got {pack_size}")
    multiple = cp_multiple(cp_size)
    if pack_size % multiple:
        lower = pack_size // multiple * multiple
        raise ValueError(
            f"pack_size={pack_size} is not a multiple of 2*cp_size={multiple}; context parallelism "
            f"splits every sequence into {multiple} equal chunks: use pack_size={lower + multiple}"
            + (f" or {lower}" if lower else "")
        )


def round_up_to_cp(lengths: np.ndarray | int, cp_size: int) -> np.ndarray:
    """Lengths rounded up to a multiple of ``cp_multiple(cp_size)``, as int64.

    >>> round_up_to_cp(np.array([1, 4, 5, 8]), 2).tolist()
    [4, 4, 8, 8]
    >>> round_up_to_cp(np.array([1, 4, 5]), 1).tolist()
    [1, 4, 5]
    """
    multiple = cp_multiple(cp_size)
    lengths = np.asarray(lengths, dtype=np.int64)
    return -(-lengths // multiple) * multiple
