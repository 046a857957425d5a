"""The THD format's two rules that every stage follows, in one torch-free home.

1. The CP slot rule. Transformer Engine cuts every sequence into ``2*cp_size`` equal chunks, so
   under context parallelism (``cp_size > 1``) a sequence of length ``n`` occupies
   ``ceil(n / (2*cp_size)) * 2*cp_size`` slots, and a pack's size (every padded slot) must be a
   multiple of ``2*cp_size``. The planners size their bins with it (``thdpack.plan``), the packer
   lays tokens out by it (``thdpack.packing.layout``), the training config and the THD record
   (``thdpack.thd.meta``) check it.
2. The ignored label: ``IGNORE_INDEX`` (-100) marks a token that predicts nothing (padding, a
   masked prompt token, a sequence's last token); the loss skips it.

Pure Python and numpy, so the numpy-only planner imports it without torch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from thdpack._settings import check_int

IGNORE_INDEX = -100
"""Label of tokens that predict nothing (padding, masked prompt tokens, sequence ends)."""


def check_cp_size(cp_size: object) -> int:
    """``cp_size`` as an ``int``: ``TypeError`` unless an integer, ``ValueError`` below 1."""
    return check_int("cp_size", cp_size, 1)


def cp_multiple(cp_size: int) -> int:
    """Every sequence's padded length is a multiple of this: ``2*cp_size`` under CP, else 1.

    >>> cp_multiple(1), cp_multiple(2), cp_multiple(4)
    (1, 4, 8)
    """
    cp_size = check_cp_size(cp_size)
    return 2 * cp_size if cp_size > 1 else 1


def check_pack_size(pack_size: int, cp_size: int) -> None:
    """Raise unless ``pack_size`` is an integer >= 1 and a multiple of ``cp_multiple(cp_size)``.

    >>> check_pack_size(30, 2)
    Traceback (most recent call last):
    ...
    ValueError: pack_size=30 is not a multiple of 2*cp_size=4; ...: use pack_size=32 or 28
    """
    pack_size = check_int("pack_size", pack_size, 1)
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


def _sequence(s: int) -> str:
    return f"sequence {s}"


def check_cp_multiple(lengths_padded_S: np.ndarray, cp_size: int, where: Callable[[int], str] = _sequence) -> None:
    """Every padded slot a multiple of ``2*cp_size``, else ``ValueError`` naming the first (``where(s)``).

    >>> check_cp_multiple(np.array([4, 6]), 2)
    Traceback (most recent call last):
    ...
    ValueError: sequence 1 has padded length 6, not a multiple of 2*cp_size=4; ...
    """
    multiple = cp_multiple(cp_size)
    if multiple == 1:
        return
    lengths_padded_S = np.asarray(lengths_padded_S)
    bad = lengths_padded_S % multiple != 0
    if bad.any():
        s = int(np.argmax(bad))
        raise ValueError(
            f"{where(s)} has padded length {int(lengths_padded_S[s])}, not a multiple of 2*cp_size={multiple}; "
            f"pad every sequence to a multiple of {multiple} (plan_packs(..., cp_size={cp_size}) does)"
        )
