"""The parts of a CP shard: the rows each attention call of its rank computes, each with its own record.

A Transformer Engine layout shard is one part over all ``cp_size`` ranks. Under a per-sequence
placement a rank computes one part per split group holding its entries (largest first: TE's
layout within the group, over the group's ranks), then its whole entries (the local kernel, no
communication); ``thdpack.layout.ranks.rank_parts`` says which rows and entries each part takes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from thdpack.layout.ranks import rank_parts
from thdpack.thd.meta import ThdMeta


class ShardPart(NamedTuple):
    """One part of a placed CP shard: the rows one attention call computes."""

    group_start: int
    """First rank of the part's group (the rank itself for the whole part)."""
    group_size: int
    """Ranks of the group; 1 = the whole part (entries whole on this rank: no communication)."""
    rows: slice
    """The part's rows of the shard (``[start, stop)``, parts back to back in shard order)."""
    entries_S: np.ndarray
    """(S_part,) int64 the batch entries of the part, in its order."""
    meta: ThdMeta
    """The part's own record: for a split group a TE-layout shard of its entries (``cp_size`` =
    ``group_size``, ``cp_rank`` = rank - ``group_start``); for the whole part an unsharded batch of
    its entries (entries with an empty slot left out: they have no rows)."""


def shard_parts(meta: ThdMeta) -> tuple[ShardPart, ...]:
    """The parts the CP shard ``meta`` describes, back to back in shard order: one per split group
    holding entries of its rank (largest group first), then its whole entries (when they take
    rows). A TE-layout shard is one part, over all ``cp_size`` ranks, described by ``meta``.
    Cached on ``meta``.

    >>> from thdpack.thd.meta import EntryGroups
    >>> groups = EntryGroups(np.array([2, 1, 1, 1, 1]), np.array([0, 1, 0, 0, 1]), 2)
    >>> meta = ThdMeta.from_lengths([6, 3, 1, 0, 0], [8, 3, 1, 3, 1], groups=groups).for_rank(2, 1)
    >>> parts = shard_parts(meta)
    >>> [(p.group_start, p.group_size, p.rows, p.entries_S.tolist()) for p in parts]
    [(0, 2, slice(0, 4, None), [0]), (1, 1, slice(4, 8, None), [1, 4])]
    >>> parts[0].meta.cp_size, parts[0].meta.cp_rank, parts[1].meta.lengths
    (2, 1, (3, 0))
    """
    if meta.cp_size == 1:
        raise ValueError("an unsharded THD batch has no CP parts; shard it (thdpack.cp.shard) first")
    return meta.cached("parts", lambda: _build(meta))


def _build(meta: ThdMeta) -> tuple[ShardPart, ...]:
    groups = meta.groups
    if groups is None:  # one part, over all ranks, described by the shard's own record
        everything = np.arange(meta.num_sequences, dtype=np.int64)
        return (ShardPart(0, meta.cp_size, slice(0, meta.local_tokens), everything, meta),)
    parts = []
    for part in rank_parts(meta.lengths_padded_S, meta.cp_size, meta.cp_rank, groups.size_S, groups.start_S):
        real, slots = meta.lengths_S[part.entries_S], meta.lengths_padded_S[part.entries_S]
        widest = int(slots.max())
        if part.group_size > 1:
            g, rank_in_group = part.group_size, meta.cp_rank - part.group_start
            record = ThdMeta.from_lengths(real, slots, cp_size=g, cp_rank=rank_in_group, max_seqlen=widest)
        else:
            record = ThdMeta.from_lengths(real, slots, max_seqlen=widest)
        parts.append(ShardPart(*part, record))
    held = parts[-1].rows.stop if parts else 0
    assert held == meta.local_tokens, f"the parts hold {held} rows, the shard {meta.local_tokens}"
    return tuple(parts)
