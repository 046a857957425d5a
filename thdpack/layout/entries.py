"""CpLayout: the global token layout of a batch's entries under a per-sequence CP placement.

Per entry (a sequence, or a placed pack's padding entry) its real length, its slot and its group;
entries are stored back to back in their slots, in batch order. ``CpLayout.check`` holds a layout
to the rules (allowed, aligned groups; a split slot a multiple of ``2g``; every rank of every pack
an equal share); ``rank_sums`` adds a value per entry to every rank of its group.

Legend: ``S`` entries, ``E`` entries of a plan, ``P`` packs, ``R`` ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from thdpack.layout.ranks import rank_indices
from thdpack.layout.rules import check_groups, sequence_name, slot_multiple


class CpLayout(NamedTuple):
    """The global token layout of one pack (or of several packs of a batch, concatenated):
    per entry its real length, slot, and group, tail-padding entries included."""

    lengths_S: np.ndarray
    """(S,) int64 real tokens (0 for a padding entry)."""
    slots_S: np.ndarray
    """(S,) int64 tokens each entry occupies (the THD batch's ``cu_seqlens_padded`` differences)."""
    group_size_S: np.ndarray
    """(S,) int64 ranks of each entry's group (1 = whole)."""
    group_start_S: np.ndarray
    """(S,) int64 first rank of each entry's group."""

    def rank_indices(self, cp_size: int, rank: int) -> np.ndarray:
        """(T_local,) global token indices rank ``rank`` holds, in its local order
        (``thdpack.layout.rank_indices`` of this layout)."""
        return rank_indices(self.slots_S, cp_size, rank, self.group_size_S, self.group_start_S)

    @classmethod
    def concat(cls, layouts: Sequence[CpLayout]) -> CpLayout:
        """The layout of packs stored one after another (a batch of several packs): a rank's
        split groups gather the sequences of every pack, in batch order, then its whole entries."""
        return cls(*(np.concatenate([getattr(x, f) for x in layouts]) for f in cls._fields))

    def check(
        self, cp_size: int, where: Callable[[int], str] = sequence_name, pack_S: np.ndarray | None = None
    ) -> None:
        """``ValueError`` naming the first faulty entry (``where(s)``) and its value: a group size not
        allowed for ``cp_size``, a misaligned group (``check_groups``), a split entry whose slot is
        not a multiple of ``2 * group_size`` (TE's rule within the group; a whole entry's slot is
        free), or a rank over its share: every rank must hold ``sum(slots) / cp_size`` tokens of
        the layout, or with ``pack_S`` ((S,) the pack of each entry, packs in order) of every pack
        (its budget), so that the shards are equal. Real lengths within the slots are the THD
        record's check.

        >>> CpLayout(np.array([5, 2]), np.array([6, 2]), np.array([2, 1]), np.array([0, 1])).check(2)
        Traceback (most recent call last):
        ...
        ValueError: sequence 0 is split over 2 ranks but has a slot of 6 tokens, not a multiple of 2*2=4; ...
        """
        check_groups(self.group_size_S, self.group_start_S, cp_size, where)
        multiple_S = slot_multiple(self.group_size_S)  # 1 for a whole entry: any slot
        bad = self.slots_S % multiple_S != 0
        if bad.any():
            s = int(np.argmax(bad))
            g, slot, multiple = int(self.group_size_S[s]), int(self.slots_S[s]), int(multiple_S[s])
            raise ValueError(
                f"{where(s)} is split over {g} ranks but has a slot of {slot} tokens, not a multiple of 2*{g}="
                f"{multiple}; TE's layout cuts a split sequence into 2*{g} equal chunks: pad it to "
                f"{-(-slot // multiple) * multiple}"
            )
        named = pack_S is not None
        pack_S = np.zeros(len(self.slots_S), dtype=np.int64) if pack_S is None else np.asarray(pack_S, dtype=np.int64)
        num_packs = int(pack_S[-1]) + 1 if len(pack_S) else 0
        share_S = self.slots_S // self.group_size_S
        tokens_PR = rank_sums(pack_S, share_S, self.group_start_S, self.group_size_S, num_packs, cp_size)
        size_P = np.bincount(pack_S, weights=self.slots_S, minlength=num_packs).round().astype(np.int64)
        over = tokens_PR * cp_size > size_P[:, None]
        if over.any():
            p, r = (int(x) for x in np.unravel_index(int(np.argmax(over)), over.shape))
            what = f"pack {p}: rank {r}" if named else f"rank {r}"
            raise ValueError(
                f"{what} holds {int(tokens_PR[p, r])} tokens, over its budget of {size_P[p] / cp_size:g} (the pack's "
                f"{int(size_P[p])} tokens / cp_size={cp_size}); every rank of a pack holds an equal share (its "
                "padding entry fills what its sequences leave: PackPlacement.layout)"
            )


def rank_sums(
    pack_E: np.ndarray, value_E: np.ndarray, start_E: np.ndarray, size_E: np.ndarray, num_packs: int, cp_size: int
) -> np.ndarray:
    """(P, R) int64: ``value_E`` added to every rank of each entry's group (``size_E`` ranks from
    ``start_E``) of its pack: a difference array over ranks (``+value`` at the group's first rank,
    ``-value`` after its last), then a cumulative sum. Values must stay below 2**53 per pack.

    >>> rank_sums(np.array([0, 0, 1]), np.array([5, 2, 7]), np.array([0, 1, 0]), np.array([2, 1, 1]), 2, 2).tolist()
    [[5, 7], [7, 0]]
    """
    width = cp_size + 1
    first = np.bincount(pack_E * width + start_E, weights=value_E, minlength=num_packs * width)
    after = np.bincount(pack_E * width + start_E + size_E, weights=value_E, minlength=num_packs * width)
    diff = (first - after).round().astype(np.int64).reshape(num_packs, width)
    return np.cumsum(diff, axis=1)[:, :cp_size]
