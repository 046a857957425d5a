"""Pieces: a set of token ranges of a dataset's sequences, exact and canonical: what an epoch consumed.

A resumed run that plans the rest of an epoch with other settings needs what was trained as data,
not as a position in a plan it can no longer make: ``Pieces`` holds it, and a checkpoint records it
(``to_arrays``) with a digest anyone can recompute. A piece is ``length`` tokens of sequence
``sample`` from token ``start``; pieces are kept sorted, disjoint and merged, one form per set, so
equal sets have equal arrays and digests. An overlap is a ``ValueError``: a token consumed twice is
what the record rules out.

On disk: ``whole``, a bitmap of the sequences held whole (``np.packbits``), and ``sample`` /
``start`` / ``length`` (int64) of the pieces of the others; ``digest`` is
``hashlib.sha256(b"".join(a.tobytes() for a in arrays))`` of those four arrays in that order
(little-endian int64).

Legend: ``S`` sequences of the dataset, ``R`` pieces.

>>> lengths_S = np.array([4, 6, 3])
>>> done = Pieces.of([1, 0], [0, 0], [2, 4])          # sequence 0 whole, tokens 0..1 of sequence 1
>>> rest = Pieces.whole(lengths_S).minus(done)
>>> rest.sample.tolist(), rest.start.tolist(), rest.length.tolist()
([1, 2], [2, 0], [4, 3])
>>> done.union(rest) == Pieces.whole(lengths_S)
True
>>> done.count_whole(lengths_S), done.tokens
(1, 6)
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

_KEY_LIMIT = 2**62
"""Pieces are matched by the key ``sample * stride + start``; it must stay inside int64."""


def _int64(values: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


@dataclass(frozen=True, eq=False)
class Pieces:
    """Token ranges of sequences in canonical form (module docstring); make one with ``of``,
    ``whole``, ``empty`` or ``from_arrays``."""

    sample: np.ndarray
    """(R,) int64 sequence of each piece, non-decreasing."""
    start: np.ndarray
    """(R,) int64 first token of each piece in its sequence."""
    length: np.ndarray
    """(R,) int64 tokens of each piece, >= 1."""

    @classmethod
    def empty(cls) -> Pieces:
        none = np.zeros(0, dtype=np.int64)
        return cls(none, none, none)

    @classmethod
    def whole(cls, lengths_S: np.ndarray) -> Pieces:
        """Every sequence whole: ``(s, 0, lengths_S[s])``."""
        lengths_S = _int64(lengths_S)
        return cls(np.arange(len(lengths_S), dtype=np.int64), np.zeros(len(lengths_S), dtype=np.int64), lengths_S)

    @classmethod
    def of(cls, sample: Sequence[int] | np.ndarray, start: Sequence[int] | np.ndarray,
           length: Sequence[int] | np.ndarray) -> Pieces:  # fmt: skip
        """The pieces ``(sample[r], start[r], length[r])`` in canonical form; ``ValueError`` when two
        overlap (naming the sequence and the tokens) or a length is not positive."""
        sample, start, length = _int64(sample), _int64(start), _int64(length)
        if not len(sample) == len(start) == len(length):
            raise ValueError(f"pieces need one sample, start and length each, got {len(sample)}, {len(start)}, "
                             f"{len(length)}")  # fmt: skip
        if len(sample) and (length.min() < 1 or start.min() < 0):
            raise ValueError("a piece needs a start >= 0 and a length >= 1")
        order = np.lexsort((start, sample))
        sample, start, length = sample[order], start[order], length[order]
        end = start + length
        same = sample[1:] == sample[:-1]
        overlap = same & (start[1:] < end[:-1])
        if overlap.any():
            i = int(np.argmax(overlap)) + 1
            raise ValueError(
                f"sequence {int(sample[i])}: tokens [{int(start[i])}, {int(end[i])}) overlap tokens "
                f"[{int(start[i - 1])}, {int(end[i - 1])}): a token would be consumed twice"
            )
        joins = np.concatenate([[False], same & (start[1:] == end[:-1])])
        if joins.any():  # contiguous pieces of one sequence become one
            first = np.flatnonzero(~joins)
            last = np.concatenate([first[1:] - 1, [len(sample) - 1]])
            sample, start, length = sample[first], start[first], end[last] - start[first]
        return cls(sample, start, length)

    # -- what it holds ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.sample)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Pieces):
            return NotImplemented
        return all(np.array_equal(a, b) for a, b in zip(self._arrays(), other._arrays(), strict=True))

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.sample, self.start, self.length

    @property
    def end(self) -> np.ndarray:
        """(R,) int64 one past the last token of each piece."""
        return self.start + self.length

    @property
    def tokens(self) -> int:
        return int(self.length.sum())

    def whole_mask(self, lengths_S: np.ndarray) -> np.ndarray:
        """(R,) bool: the pieces that are a whole sequence of ``lengths_S``."""
        return (self.start == 0) & (self.length == _int64(lengths_S)[self.sample])

    def count_whole(self, lengths_S: np.ndarray) -> int:
        """Sequences held whole."""
        return int(self.whole_mask(lengths_S).sum())

    def count_sequences(self) -> int:
        """Sequences with at least one token held."""
        return int(np.count_nonzero(np.diff(self.sample))) + 1 if len(self) else 0

    # -- set operations ----------------------------------------------------------------------
    def select(self, keep: np.ndarray) -> Pieces:
        """The pieces where the (R,) bool ``keep`` is True."""
        return Pieces(self.sample[keep], self.start[keep], self.length[keep])

    def union(self, other: Pieces) -> Pieces:
        """Both sets; ``ValueError`` when they share a token."""
        return Pieces.of(*(np.concatenate([a, b]) for a, b in zip(self._arrays(), other._arrays(), strict=True)))

    def owners(self, inner: Pieces) -> np.ndarray:
        """(len(inner),) int64 the index of the piece of ``self`` that holds each piece of ``inner``;
        ``ValueError`` when one lies outside every piece."""
        if not len(inner):
            return np.zeros(0, dtype=np.int64)
        if not len(self):
            raise ValueError(f"sequence {int(inner.sample[0])}: tokens [{int(inner.start[0])}, "
                             f"{int(inner.end[0])}) are not within the set")  # fmt: skip
        stride = int(max(self.end.max(), inner.end.max())) + 1
        if max(int(self.sample.max()), int(inner.sample.max())) * stride + stride >= _KEY_LIMIT:
            raise ValueError(f"{int(self.sample.max()) + 1:,} sequences of up to {stride - 1:,} tokens are past the "
                             "sequences x tokens that thdpack tracks exactly (2**62)")  # fmt: skip
        owner = np.searchsorted(self.sample * stride + self.start, inner.sample * stride + inner.start, "right") - 1
        safe = np.maximum(owner, 0)
        inside = (owner >= 0) & (self.sample[safe] == inner.sample) & (inner.end <= self.end[safe])
        if not inside.all():
            r = int(np.argmin(inside))
            raise ValueError(
                f"sequence {int(inner.sample[r])}: tokens [{int(inner.start[r])}, {int(inner.end[r])}) are not "
                "within the set"
            )
        return owner

    def minus(self, inner: Pieces) -> Pieces:
        """``self`` without ``inner``, which must lie within it (``ValueError`` otherwise)."""
        owner = self.owners(inner)
        if not len(inner):
            return self
        changes = np.concatenate([[True], owner[1:] != owner[:-1]])
        first, last = changes, np.concatenate([changes[1:], [True]])
        previous_end = np.where(first, self.start[owner], np.concatenate([[0], inner.end[:-1]]))
        before = inner.start - previous_end  # the gap before each inner piece, inside its owner
        after = self.end[owner[last]] - inner.end[last]  # the gap after each owner's last inner piece
        untouched = np.ones(len(self), dtype=bool)
        untouched[owner] = False
        keep_before, keep_after = before > 0, after > 0
        return Pieces.of(
            np.concatenate([self.sample[owner][keep_before], inner.sample[last][keep_after], self.sample[untouched]]),
            np.concatenate([previous_end[keep_before], inner.end[last][keep_after], self.start[untouched]]),
            np.concatenate([before[keep_before], after[keep_after], self.length[untouched]]),
        )

    # -- on disk ---------------------------------------------------------------------------
    def to_arrays(self, lengths_S: np.ndarray) -> dict[str, np.ndarray]:
        """``{"whole": bitmap of the sequences held whole, "sample", "start", "length": the other pieces}``."""
        whole_R = self.whole_mask(lengths_S)
        bits_S = np.zeros(len(lengths_S), dtype=bool)
        bits_S[self.sample[whole_R]] = True
        rest = ~whole_R
        return {
            "whole": np.packbits(bits_S),
            "sample": self.sample[rest],
            "start": self.start[rest],
            "length": self.length[rest],
        }

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], lengths_S: np.ndarray) -> Pieces:
        """The pieces ``to_arrays`` wrote, for sequences of ``lengths_S``; ``ValueError`` when they do
        not fit them."""
        lengths_S = _int64(lengths_S)
        bits = np.asarray(arrays["whole"], dtype=np.uint8)
        if len(bits) != -(-len(lengths_S) // 8):
            raise ValueError(f"the record's bitmap holds {len(bits) * 8} sequences, not the data's {len(lengths_S):,}")
        whole = np.flatnonzero(np.unpackbits(bits, count=len(lengths_S)))
        sample, start, length = (_int64(arrays[key]) for key in ("sample", "start", "length"))
        if len(sample) and (sample.max() >= len(lengths_S) or (start + length > lengths_S[sample]).any()):
            raise ValueError(f"the record holds pieces past the end of the data's {len(lengths_S):,} sequences")
        return cls.of(
            np.concatenate([whole, sample]),
            np.concatenate([np.zeros(len(whole), dtype=np.int64), start]),
            np.concatenate([lengths_S[whole], length]),
        )


def arrays_digest(arrays: Mapping[str, np.ndarray]) -> str:
    """The sha256 of ``Pieces.to_arrays``' arrays (module docstring)."""
    parts = [np.ascontiguousarray(arrays["whole"], dtype=np.uint8)]
    parts += [np.ascontiguousarray(arrays[key], dtype="<i8") for key in ("sample", "start", "length")]
    return hashlib.sha256(b"".join(part.tobytes() for part in parts)).hexdigest()
