"""The THD format's rules: the CP slot rule, the CP sizes and groups, and the ignored label.

One slot rule: a sequence split over a group of ``g > 1`` CP ranks is cut into ``2g`` equal chunks
(rank ``j`` keeps ``j`` and ``2g-1-j``), so its slot is a multiple of ``2g``
(:func:`slot_multiple`); a whole one takes its length. Transformer Engine's layout is the rule
with ``g = cp_size`` for every sequence, which makes the pack size a multiple of ``2*cp_size``
too. ``IGNORE_INDEX`` (-100) labels a token that predicts nothing; the loss skips it.

Legend: ``S`` sequences (entries), ``O`` groups (options).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from thdpack._settings import check_int

IGNORE_INDEX = -100
"""Label of tokens that predict nothing (padding, masked prompt tokens, sequence ends)."""

_Size = TypeVar("_Size", int, np.ndarray)


def check_cp_size(cp_size: object) -> int:
    """``cp_size`` as an ``int``: ``TypeError`` unless an integer, ``ValueError`` below 1."""
    return check_int("cp_size", cp_size, 1)


def check_cp(cp_size: Any, cp_rank: Any) -> int:
    """``cp_size`` as an ``int`` (:func:`check_cp_size`), and ``0 <= cp_rank < cp_size``, else
    ``ValueError``."""
    cp_size = check_cp_size(cp_size)
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, (int, np.integer)) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, {cp_size}), got {cp_rank!r}")
    return cp_size


def slot_multiple(group_size: _Size) -> _Size:
    """The multiple a sequence's slot is made of, per group size (an int or an array of them):
    ``2g`` for a sequence split over ``g > 1`` ranks, 1 for one whole on its rank.

    >>> slot_multiple(1), slot_multiple(4), slot_multiple(np.array([1, 2, 8])).tolist()
    (1, 8, [1, 4, 16])
    """
    # 2g chunks; for g == 1 the same expression gives 2 - 1 = 1, for ints and arrays alike
    return 2 * group_size - (group_size == 1)


def slot_lengths(lengths_S: np.ndarray, group_size_S: np.ndarray | int) -> np.ndarray:
    """Each sequence's slot: its length rounded up to its :func:`slot_multiple` (its length when whole).

    Args:
        lengths_S: (S,) int, real lengths.
        group_size_S: (S,) int, each sequence's group size, or one size for every sequence.

    Returns:
        (S,) int64 slots.

    >>> slot_lengths(np.array([5, 5, 5]), np.array([1, 2, 4])).tolist()
    [5, 8, 8]
    """
    step = slot_multiple(np.asarray(group_size_S, dtype=np.int64))
    return -(-np.asarray(lengths_S, dtype=np.int64) // step) * step


def cp_multiple(cp_size: int) -> int:
    """Every sequence's padded length in Transformer Engine's layout is a multiple of this:
    ``2*cp_size`` under CP, else 1 (:func:`slot_multiple` with ``g = cp_size``).

    >>> cp_multiple(1), cp_multiple(2), cp_multiple(4)
    (1, 4, 8)
    """
    return slot_multiple(check_cp_size(cp_size))


def round_up_to_cp(lengths: np.ndarray | int, cp_size: int) -> np.ndarray:
    """Lengths rounded up to a multiple of ``cp_multiple(cp_size)``, as int64: their slots in
    Transformer Engine's layout.

    >>> round_up_to_cp(np.array([1, 4, 5, 8]), 2).tolist()
    [4, 4, 8, 8]
    >>> round_up_to_cp(np.array([1, 4, 5]), 1).tolist()
    [1, 4, 5]
    """
    return slot_lengths(lengths, check_cp_size(cp_size))


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


def sequence_name(s: int) -> str:
    """How an error names entry ``s`` by default (callers pass ``where`` to name the pack too)."""
    return f"sequence {s}"


def check_cp_multiple(lengths_padded_S: np.ndarray, cp_size: int, where: Callable[[int], str] = sequence_name) -> None:
    """Every padded slot a multiple of ``2*cp_size`` (Transformer Engine's layout), else
    ``ValueError`` naming the first (``where(s)``). ``cp_size``: an int >= 1 (:func:`check_cp_size`).

    >>> check_cp_multiple(np.array([4, 6]), 2)
    Traceback (most recent call last):
    ...
    ValueError: sequence 1 has padded length 6, not a multiple of 2*cp_size=4; ...
    """
    multiple = slot_multiple(cp_size)
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


def group_sizes(cp_size: int) -> tuple[int, ...]:
    """The group sizes a sequence may be placed on for ``cp_size`` ranks, ascending: 1 (whole),
    the powers of 2 dividing ``cp_size``, and ``cp_size`` (Transformer Engine's layout).

    >>> group_sizes(8), group_sizes(6), group_sizes(3), group_sizes(1)
    ((1, 2, 4, 8), (1, 2, 6), (1, 3), (1,))
    """
    cp_size = check_cp_size(cp_size)
    sizes = {1, cp_size}
    g = 2
    while g < cp_size and cp_size % g == 0:
        sizes.add(g)
        g *= 2
    return tuple(sorted(sizes))


def check_groups(
    group_size_S: np.ndarray, group_start_S: np.ndarray, cp_size: int, where: Callable[[int], str] = sequence_name
) -> None:
    """``ValueError`` naming the first entry (``where(s)``), its group and the valid sizes when its
    group size is not one of :func:`group_sizes` ``(cp_size)``, or its group is misaligned or
    reaches past the last rank. ``cp_size``: an int >= 1.

    >>> check_groups(np.array([4, 4]), np.array([0, 2]), 4)
    Traceback (most recent call last):
    ...
    ValueError: sequence 1 is placed on ranks 2..5 (a group of 4 starting at rank 2); a group of 4 must ...
    """
    bad = ~_allowed_table(cp_size).take(group_size_S, mode="clip")
    if bad.any():
        s = int(np.argmax(bad))
        g = int(group_size_S[s])
        reason = "does not divide" if g < 1 or cp_size % g else "is not a power of 2 below"
        raise ValueError(
            f"{where(s)} is placed on a group of {g} ranks, which {reason} cp_size={cp_size}; "
            f"valid group sizes: {_listed(cp_size)} (1 = whole on one rank)"
        )
    bad = (group_start_S < 0) | (group_start_S % group_size_S != 0) | (group_start_S + group_size_S > cp_size)
    if bad.any():
        s = int(np.argmax(bad))
        g, g0 = int(group_size_S[s]), int(group_start_S[s])
        raise ValueError(
            f"{where(s)} is placed on ranks {g0}..{g0 + g - 1} (a group of {g} starting at rank {g0}); a group "
            f"of {g} must start at a multiple of {g} in [0, {cp_size - g}] (groups are aligned; valid group sizes "
            f"for cp_size={cp_size}: {_listed(cp_size)})"
        )


def _listed(cp_size: int) -> str:
    return ", ".join(map(str, group_sizes(cp_size)))


@functools.cache
def _allowed_table(cp_size: int) -> np.ndarray:
    """(cp_size + 2,) bool, True at the allowed group sizes (a lookup: ``np.isin`` costs tens of
    microseconds per batch); sizes below 0 or above ``cp_size`` clip onto False entries."""
    table = np.zeros(cp_size + 2, dtype=bool)
    table[list(group_sizes(cp_size))] = True
    table.flags.writeable = False
    return table


def group_options(cp_size: int, sizes: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(size_O, start_O)``: every aligned group (``start % size == 0``) of the given sizes
    (default: all of :func:`group_sizes`), the largest groups first, then by start rank.

    >>> [a.tolist() for a in group_options(4)]
    [[4, 2, 2, 1, 1, 1, 1], [0, 0, 2, 0, 1, 2, 3]]
    """
    allowed = group_sizes(cp_size)
    sizes = allowed if sizes is None else tuple(sizes)
    bad = [g for g in sizes if g not in allowed]
    if bad:
        raise ValueError(f"group size {bad[0]} is not allowed for cp_size={cp_size}; valid: {allowed}")
    descending = sorted(set(sizes), reverse=True)
    size_O = np.concatenate([np.full(cp_size // g, g) for g in descending]).astype(np.int64)
    start_O = np.concatenate([np.arange(0, cp_size, g) for g in descending]).astype(np.int64)
    return size_O, start_O
