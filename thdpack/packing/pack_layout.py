"""The pack layout in one place: CP padding, seq_lens_padded, position ids, labels, padding.

Under context parallelism each sequence takes its length rounded up to a multiple of
``2*cp_size`` (CP padding after it), and the pack's tail is added to the last sequence, so
``sum(seq_lens_padded) == pack_size`` as in NeMo AutoModel's packs:

    seq_lens [3, 5], pack_size 16, cp_size 2 (multiple 4):
    tokens          a a a . b b b b b . . . . . . .
    seq_lens_padded [4, 12]     (3 -> 4; 5 -> 8, + 4 tail)
    position_ids    0 1 2 3 0 1 2 3 4 5 6 7 8 9 10 11

Under a per-sequence CP placement the layout is the placement's (``PackPlacement.layout``): a
split sequence's slot is a multiple of ``2g``, a whole one's is its length, and the tail is one
padding entry per rank:

    seq_lens [6, 3, 1], pack_size 16, cp_size 2; 6 split over both ranks, 3 whole on rank 1, 1 on rank 0
    tokens          a a a a a a . . b b b c . . . .
    seq_lens        [6, 3, 1, 0, 0]
    seq_lens_padded [8, 3, 1, 3, 1]     (6 -> 8; rank 0: 4 + 1 + 3 tail; rank 1: 4 + 3 + 1 tail)

Positions restart at 0 per sequence and run on through its padding; padding carries the pad id
and label ``IGNORE_INDEX``. Numpy on the host: packs are built in data-loader workers.

Legend: ``T`` tokens of a pack or stream, ``S`` sequences.
"""

from __future__ import annotations

import numpy as np

from thdpack.layout.entries import CpLayout
from thdpack.layout.placement import PackPlacement
from thdpack.layout.rules import IGNORE_INDEX, check_pack_size, cp_multiple, round_up_to_cp


def pack_seq_lens_padded(seq_lens: np.ndarray, pack_size: int, cp_size: int) -> np.ndarray:
    """Padded lengths of one pack: CP-rounded, with the tail padding added to the last entry.

    Args:
        seq_lens: (S,) int, S >= 1, every entry >= 1: real lengths in placement order.
        pack_size: tokens of the pack, a multiple of ``cp_multiple(cp_size)``.
        cp_size: context-parallel size.

    Returns:
        (S,) int64 with ``sum == pack_size``; every entry a multiple of ``2*cp_size`` when
        ``cp_size > 1`` (because ``pack_size`` is).

    >>> pack_seq_lens_padded(np.array([3, 4, 2]), 10, 1).tolist()
    [3, 4, 3]
    >>> pack_seq_lens_padded(np.array([3, 5]), 16, 2).tolist()
    [4, 12]
    """
    check_pack_size(pack_size, cp_size)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    if seq_lens.ndim != 1 or len(seq_lens) == 0:
        raise ValueError(f"a pack needs at least one sequence, got seq_lens of shape {seq_lens.shape}")
    if (seq_lens < 1).any():
        i = int(np.argmax(seq_lens < 1))
        raise ValueError(f"sequence {i} of the pack has length {int(seq_lens[i])}; lengths must be >= 1")
    padded = round_up_to_cp(seq_lens, cp_size)
    used = int(padded.sum())
    if used > pack_size:
        raise ValueError(
            f"the pack's sequences take {used} slots (real lengths {seq_lens.tolist()}, rounded to "
            f"multiples of {cp_multiple(cp_size)}), over pack_size={pack_size}"
        )
    padded[-1] += pack_size - used
    return padded


def placed_seq_lens_padded(seq_lens: np.ndarray, placement: PackPlacement) -> CpLayout:
    """The entries of one pack laid out by its CP placement (its ``PackPlacement.layout``), after
    checking that the pack's sequences are the ones it was made for.

    Args:
        seq_lens: (S,) int >= 1, the real lengths of the pack's sequences in placement order; they
            must be the lengths ``placement`` was made for.
        placement: the pack's placement (``plan.placement.pack(i)``).

    Returns:
        The pack's ``CpLayout`` (``PackPlacement.layout``): ``lengths_S`` the pack's ``seq_lens``
        (the real lengths, then ``cp_size`` zeros), ``slots_S`` its ``seq_lens_padded`` (sum ==
        ``pack_size``), ``group_size_S`` / ``group_start_S`` its ``cp_group_size`` / ``cp_group_start``.

    >>> pack = PackPlacement.from_groups([6, 3, 1], {(0, 2): [0], (1, 1): [1], (0, 1): [2]}, cp_size=2, pack_size=16)
    >>> layout = placed_seq_lens_padded(np.array([6, 3, 1]), pack)
    >>> layout.lengths_S.tolist(), layout.slots_S.tolist()
    ([6, 3, 1, 0, 0], [8, 3, 1, 3, 1])
    >>> placed_seq_lens_padded(np.array([6, 4, 1]), pack)
    Traceback (most recent call last):
    ...
    ValueError: sequence 1 of the pack has 4 tokens but its CP placement was made for 3; ...
    """
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    if seq_lens.shape != placement.lengths_S.shape:
        raise ValueError(
            f"the pack has {seq_lens.size} sequences but its CP placement places {placement.lengths_S.size}; "
            "a placement describes the pack of the plan it came with (plan.placement.pack(i) for plan[i])"
        )
    wrong = seq_lens != placement.lengths_S
    if wrong.any():
        s = int(np.argmax(wrong))
        raise ValueError(
            f"sequence {s} of the pack has {int(seq_lens[s])} tokens but its CP placement was made for "
            f"{int(placement.lengths_S[s])}; pass the samples the plan was made for"
        )
    return placement.layout()


def position_ids(seq_lens_padded: np.ndarray) -> np.ndarray:
    """Positions that restart at 0 at every sequence and run on through its padding.

    Args:
        seq_lens_padded: (S,) int >= 0.

    Returns:
        (T,) int64 with ``T = sum(seq_lens_padded)``.

    >>> position_ids(np.array([4, 12])).tolist()
    [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    """
    seq_lens_padded = np.asarray(seq_lens_padded, dtype=np.int64)
    starts = np.cumsum(seq_lens_padded) - seq_lens_padded
    total = int(seq_lens_padded.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(starts, seq_lens_padded)


def next_token_labels(input_ids: np.ndarray, seq_lens: np.ndarray | None = None) -> np.ndarray:
    """Next-token labels inside each sequence: ``labels[t] = input_ids[t+1]``, and the last token
    of every sequence gets ``IGNORE_INDEX`` (it never predicts the next sequence's first token).

    Args:
        input_ids: (T,) int, sequences back to back.
        seq_lens: (S,) int summing to T; None means one sequence.

    Returns:
        (T,) int64, a new array.

    >>> next_token_labels(np.array([5, 6, 7, 8, 9]), np.array([3, 2])).tolist()
    [6, 7, -100, 9, -100]
    """
    input_ids = np.asarray(input_ids, dtype=np.int64)
    labels = np.empty_like(input_ids)
    labels[:-1] = input_ids[1:]
    ends = np.array([len(input_ids)]) if seq_lens is None else np.cumsum(seq_lens)
    if len(ends) and ends[-1] != len(input_ids):
        raise ValueError(f"seq_lens sum to {int(ends[-1])} but input_ids has {len(input_ids)} tokens")
    labels[ends[ends > 0] - 1] = IGNORE_INDEX
    return labels


def apply_loss_mask(labels: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """A copy of ``labels`` with ``IGNORE_INDEX`` wherever ``loss_mask`` is 0 (e.g. prompt tokens).

    >>> apply_loss_mask(np.array([7, 8, 9]), np.array([0, 1, 1])).tolist()
    [-100, 8, 9]
    """
    return np.where(np.asarray(loss_mask) == 0, IGNORE_INDEX, np.asarray(labels, dtype=np.int64))
