"""A context-parallel rank's tokens: which global tokens rank ``r`` holds, in its local order.

Rank ``r`` holds its split groups' entries first, largest group first, each entry giving chunk
``j = r - group_start`` then chunk ``2g-1-j`` of its slot, then its whole entries, in storage
order. Transformer Engine's layout is the case where every entry is split over all ranks (rank
``r`` keeps chunks ``r`` and ``2*cp_size-1-r`` of every sequence: TE's
``thd_get_partitioned_indices``), so :func:`rank_indices` is the one map for both;
:func:`rank_parts` cuts a rank's tokens into the parts one attention call each computes.

Legend: ``S`` entries, ``M`` the rank's entries, ``T_local`` the rank's tokens.

>>> rank_indices(np.array([8, 8]), 2, 0).tolist()    # TE: chunks 0 and 3 of each sequence
[0, 1, 6, 7, 8, 9, 14, 15]
>>> rank_indices(np.array([8, 3, 1]), 2, 1, np.array([2, 1, 1]), np.array([0, 1, 0])).tolist()
[2, 3, 4, 5, 8, 9, 10]

Legend: ``S`` entries, ``M`` the rank's entries, ``T_local`` the rank's tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from thdpack.layout.rules import slot_multiple


def rank_indices(
    slots_S: np.ndarray,
    cp_size: int,
    rank: int,
    group_size_S: np.ndarray | None = None,
    group_start_S: np.ndarray | None = None,
) -> np.ndarray:
    """(T_local,) global token indices of CP ``rank``, in its local order (the module docstring's).

    Args:
        slots_S: (S,) int, every entry's slot (``cu_seqlens_padded`` differences).
        cp_size: context-parallel ranks.
        rank: ``0 <= rank < cp_size``.
        group_size_S, group_start_S: (S,) int, every entry's group under a per-sequence
            placement; None (both): Transformer Engine's layout, every entry split over all ranks.

    Returns:
        (T_local,) global token indices, int32 (as Transformer Engine's kernel) while the layout
        holds fewer than 2**31 tokens, else int64.

    The input is a validated layout's (``ThdMeta``, ``CpLayout.check``): every split slot a
    multiple of ``2g`` and every rank holding ``sum(slots) / cp_size`` tokens.
    """
    slots_S = np.asarray(slots_S, dtype=np.int64)
    ends_S = np.cumsum(slots_S)
    starts_S = ends_S - slots_S
    total = int(ends_S[-1]) if len(ends_S) else 0
    if group_size_S is None:  # TE's layout: every entry on the one group of all ranks
        slot_M, start_M, g_M, j_M = slots_S, starts_S, cp_size, rank
    else:
        mine = _rank_entries(group_size_S, group_start_S, rank)
        slot_M, start_M = slots_S[mine], starts_S[mine]
        g_M = np.asarray(group_size_S, dtype=np.int64)[mine]
        j_M = rank - np.asarray(group_start_S, dtype=np.int64)[mine]
    chunks_M = slot_multiple(g_M)  # 2g chunks of a split entry; a whole entry is one chunk
    chunk_M = slot_M // chunks_M
    # two runs per entry: chunk j (a whole entry's slot), then chunk 2g-1-j (empty for a whole entry)
    run_start = np.empty(2 * len(slot_M), dtype=np.int64)
    run_len = np.empty_like(run_start)
    run_start[0::2] = start_M + j_M * chunk_M
    run_start[1::2] = start_M + (chunks_M - 1 - j_M) * chunk_M
    run_len[0::2] = chunk_M
    run_len[1::2] = chunk_M * (g_M > 1)
    local_start = np.cumsum(run_len) - run_len
    # inside a run the global index is the local one plus the run's offset; the per-token work in
    # the narrowest exact dtype (int32 halves the memory traffic, as TE's kernel)
    dtype = np.int32 if total < 2**31 else np.int64
    index_T = np.repeat((run_start - local_start).astype(dtype), run_len)
    index_T += np.arange(len(index_T), dtype=dtype)
    return index_T


class RankPart(NamedTuple):
    """One part of a CP rank's tokens: the rows one attention call computes (:func:`rank_parts`)."""

    group_start: int
    """First rank of the part's group (the rank itself for the whole part)."""
    group_size: int
    """Ranks of the group; 1 = the whole part (entries whole on this rank: no communication)."""
    rows: slice
    """The part's rows of the rank's tokens (``[start, stop)``, parts back to back in local order)."""
    entries_S: np.ndarray
    """(S_part,) int64 the entries of the part, in its order."""


def rank_parts(
    slots_S: np.ndarray,
    cp_size: int,
    rank: int,
    group_size_S: np.ndarray | None = None,
    group_start_S: np.ndarray | None = None,
) -> tuple[RankPart, ...]:
    """The parts of CP ``rank``'s tokens, in its local order (arguments as :func:`rank_indices`'s):
    Transformer Engine's layout is one part over all ranks; under a placement, one part per split
    group holding entries of ``rank`` (largest first), then its whole entries. An entry with an
    empty slot is left out of the whole part, and a part without rows is left out.

    >>> parts = rank_parts(np.array([8, 3, 1, 3, 1]), 2, 1, np.array([2, 1, 1, 1, 1]), np.array([0, 1, 0, 0, 1]))
    >>> [(p.group_start, p.group_size, p.rows, p.entries_S.tolist()) for p in parts]
    [(0, 2, slice(0, 4, None), [0]), (1, 1, slice(4, 8, None), [1, 4])]
    """
    slots_S = np.asarray(slots_S, dtype=np.int64)
    if group_size_S is None:
        rows = int(slots_S.sum()) // cp_size
        return (RankPart(0, cp_size, slice(0, rows), np.arange(len(slots_S), dtype=np.int64)),)
    group_size_S = np.asarray(group_size_S, dtype=np.int64)
    mine = _rank_entries(group_size_S, np.asarray(group_start_S, dtype=np.int64), rank)
    sizes = group_size_S[mine]
    parts, start = [], 0
    for entries in np.split(mine, np.flatnonzero(sizes[1:] != sizes[:-1]) + 1) if len(mine) else []:
        g = int(group_size_S[entries[0]])
        if g == 1:
            entries = entries[slots_S[entries] > 0]  # an empty slot has no rows
        rows = int(slots_S[entries].sum()) // g
        if rows:
            # one aligned group of each size contains the rank
            parts.append(RankPart(rank - rank % g, g, slice(start, start + rows), entries))
            start += rows
    return tuple(parts)


def _rank_entries(group_size_S: np.ndarray, group_start_S: np.ndarray, rank: int) -> np.ndarray:
    """(M,) int64 the entries whose group contains ``rank``: largest group first, then storage order."""
    group_size_S = np.asarray(group_size_S, dtype=np.int64)
    group_start_S = np.asarray(group_start_S, dtype=np.int64)
    mine = np.flatnonzero((group_start_S <= rank) & (rank < group_start_S + group_size_S))
    return mine[np.argsort(-group_size_S[mine], kind="stable")]
