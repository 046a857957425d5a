"""Overflow policies for sequences longer than a pack: error, drop, truncate, split — all counted.

A plan places *entries*: a whole sequence, its first ``pack_size`` tokens ("truncate"), or one
piece of it ("split": full ``pack_size`` pieces, then the remainder). Pieces are independent
sequences for attention; the packer takes their labels from the original sequence, so a
piece's last token still predicts the next piece's first token and no token is lost.

>>> e = apply_overflow(np.array([3, 10, 4]), pack_size=4, policy="split")
>>> e.sequence.tolist(), e.start.tolist(), e.length.tolist(), e.split_sequences
([0, 1, 1, 1, 2], [0, 0, 4, 8, 0], [3, 4, 4, 2, 4], 1)
>>> e = apply_overflow(np.array([3, 10, 4]), pack_size=4, policy="drop")
>>> e.sequence.tolist(), e.dropped_sequences, e.dropped_tokens
([0, 2], 1, 10)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

Overflow = Literal["error", "drop", "truncate", "split"]
OVERFLOWS: tuple[str, ...] = ("error", "drop", "truncate", "split")


@dataclass(frozen=True)
class Entries:
    """What a plan places, in dataset order."""

    length: np.ndarray
    """(E,) int64 tokens of each entry."""
    sequence: np.ndarray | None = None
    """(E,) int64 sequence of each entry; None when entry i is sequence i."""
    start: np.ndarray | None = None
    """(E,) int64 token offset inside the sequence; None when every entry starts at 0."""
    dropped_sequences: int = 0
    dropped_tokens: int = 0
    truncated_sequences: int = 0
    truncated_tokens: int = 0
    split_sequences: int = 0

    @property
    def cut(self) -> bool:
        """True when some entry is not a whole sequence."""
        return self.truncated_sequences > 0 or self.split_sequences > 0


OVERFLOW_COUNTS = ("dropped_sequences", "dropped_tokens", "truncated_sequences", "truncated_tokens", "split_sequences")
"""The counts every overflow policy reports (``Entries`` and ``PackingStats`` fields of these names)."""


def apply_overflow(lengths: np.ndarray, pack_size: int, policy: Overflow, *, first_index: int = 0) -> Entries:
    """Entries for ``lengths`` (validated, >= 1) under ``policy``; raises for ``"error"``.

    ``first_index`` is the index of ``lengths[0]`` in the caller's numbering (a streaming packer
    passes one sample at a time), so the error names the sequence the caller knows."""
    too_long = lengths > pack_size
    if not too_long.any():
        return Entries(length=lengths)
    first = int(np.argmax(too_long))
    if policy == "error":
        count = int(too_long.sum())
        total = f" ({count} sequences in total)" if count > 1 else ""
        raise ValueError(
            f"sequence {first + first_index} has {int(lengths[first])} tokens, over pack_size={pack_size}{total}; "
            "use overflow='split', 'truncate' or 'drop', or a larger pack_size"
        )
    if policy == "drop":
        keep = np.flatnonzero(~too_long)
        return Entries(
            length=lengths[keep],
            sequence=keep,
            dropped_sequences=int(too_long.sum()),
            dropped_tokens=int(lengths[too_long].sum()),
        )
    if policy == "truncate":
        return Entries(
            length=np.minimum(lengths, pack_size),
            sequence=np.arange(len(lengths), dtype=np.int64),
            start=np.zeros(len(lengths), dtype=np.int64),
            truncated_sequences=int(too_long.sum()),
            truncated_tokens=int((lengths[too_long] - pack_size).sum()),
        )
    if policy == "split":
        pieces = -(-lengths // pack_size)
        sequence = np.repeat(np.arange(len(lengths), dtype=np.int64), pieces)
        piece = np.arange(len(sequence), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        start = piece * pack_size
        return Entries(
            length=np.minimum(pack_size, lengths[sequence] - start),
            sequence=sequence,
            start=start,
            split_sequences=int(too_long.sum()),
        )
    raise ValueError(f"unknown overflow policy {policy!r}; valid: {', '.join(OVERFLOWS)}")
