"""thdpack.layout.ranks: the one rank-index function (every placement; TE's layout when every
sequence is split over all ranks) and a rank's parts."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from thdpack.layout.ranks import rank_indices, rank_parts

from support.placement_cases import placements


def te_formula(slots: np.ndarray, cp: int, rank: int) -> list[int]:
    """Transformer Engine's ``thd_partition_indices_kernel`` written out token by token (its
    binary search over ``cu_seqlens / world_size``, then head chunk or tail chunk)."""
    cu_local = np.concatenate(([0], np.cumsum(slots))) // cp
    out = []
    for token in range(int(cu_local[-1])):
        seq = int(np.searchsorted(cu_local, token, side="right")) - 1
        seq_len = int(cu_local[seq + 1] - cu_local[seq])
        index = token - int(cu_local[seq])
        offset = rank if index < seq_len // 2 else (cp - 1) * 2 - rank
        out.append(index + int(cu_local[seq]) * cp + seq_len // 2 * offset)
    return out


def test_te_layout_written_out():
    """DESIGN.md's example and a cp 4 case, by hand."""
    assert rank_indices(np.array([8, 8]), 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert rank_indices(np.array([8, 8]), 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    assert rank_indices(np.array([16]), 4, 1).tolist() == [2, 3, 12, 13]
    assert rank_indices(np.array([4, 8]), 1, 0).tolist() == list(range(12))  # one rank keeps every token
    assert rank_indices(np.array([8, 8]), 2, 0).dtype == np.int32  # as TE's kernel


@given(st.lists(st.integers(0, 12), min_size=1, max_size=8), st.sampled_from([1, 2, 3, 4, 8]))
def test_te_layout_is_tes_kernel(units, cp):
    """Every entry split over all ranks (no groups given, or g = cp given) is TE's kernel, and the
    ranks together hold every token once, slots / cp each."""
    slots = np.array(units) * 2 * cp
    held = []
    for rank in range(cp):
        got = rank_indices(slots, cp, rank)
        assert got.tolist() == te_formula(slots, cp, rank)
        g = np.full(len(slots), cp)
        assert rank_indices(slots, cp, rank, g, np.zeros_like(g)).tolist() == got.tolist()
        assert len(got) == int(slots.sum()) // cp
        held.append(got)
    assert sorted(np.concatenate(held).tolist()) == list(range(int(slots.sum())))


@given(placements())
def test_rank_indices_are_disjoint_complete_and_in_layout_order(pack):
    cp, budget = pack.cp_size, pack.pack_size // pack.cp_size
    layout = pack.layout()
    assert int(layout.slots_S.sum()) == pack.pack_size
    starts = np.cumsum(layout.slots_S) - layout.slots_S
    seen = []
    for rank in range(cp):
        index = layout.rank_indices(cp, rank)
        assert len(index) == budget  # every rank holds exactly its budget
        seen.append(index)
        # the expected local order: split groups largest first (entries in order, chunks j and
        # 2g-1-j), then the whole entries (the tail padding last)
        expected = []
        mine = [s for s in range(len(layout.slots_S))
                if layout.group_start_S[s] <= rank < layout.group_start_S[s] + layout.group_size_S[s]]  # fmt: skip
        for s in sorted(mine, key=lambda s: (-layout.group_size_S[s], s)):
            g, slot, start = int(layout.group_size_S[s]), int(layout.slots_S[s]), int(starts[s])
            if g == 1:
                expected += range(start, start + slot)
            else:
                c, j = slot // (2 * g), rank - int(layout.group_start_S[s])
                expected += range(start + j * c, start + (j + 1) * c)
                expected += range(start + (2 * g - 1 - j) * c, start + (2 * g - j) * c)
        assert index.tolist() == expected
    everything = np.concatenate(seen)
    assert sorted(everything.tolist()) == list(range(pack.pack_size))


@given(placements())
def test_split_part_of_each_group_is_te_partition_of_the_group(pack):
    """A rank's chunks of a group's sequences are TE's partition of that sub-batch (the group's
    sequences alone, over its g ranks), after the rank's larger groups."""
    layout = pack.layout()
    starts = np.cumsum(layout.slots_S) - layout.slots_S
    groups = {(int(g), int(s)) for g, s in zip(pack.group_size_S, pack.group_start_S, strict=True) if g > 1}
    for g, g0 in groups:
        members = np.flatnonzero((layout.group_size_S == g) & (layout.group_start_S == g0))
        sub_slots = layout.slots_S[members]
        to_global = np.concatenate([np.arange(n) + starts[m] for n, m in zip(sub_slots, members, strict=True)])
        for j in range(g):
            rank = g0 + j
            before = sum(int(layout.slots_S[(layout.group_size_S == big) & (layout.group_start_S == s)].sum()) // big
                         for big, s in groups if big > g and s <= rank < s + big)  # fmt: skip
            want = to_global[rank_indices(sub_slots, g, j)]
            got = layout.rank_indices(pack.cp_size, rank)
            assert got[before : before + len(want)].tolist() == want.tolist()


@given(placements())
def test_parts_cover_the_rank_in_its_order(pack):
    """A rank's parts are back to back, each a group of the rank (whole last), and their entries
    are the rank's tokens in rank_indices order."""
    layout = pack.layout()
    starts = np.cumsum(layout.slots_S) - layout.slots_S
    for rank in range(pack.cp_size):
        parts = rank_parts(layout.slots_S, pack.cp_size, rank, layout.group_size_S, layout.group_start_S)
        assert [p.group_size for p in parts] == sorted((p.group_size for p in parts), reverse=True)
        assert parts[0].rows.start == 0 and parts[-1].rows.stop == pack.pack_size // pack.cp_size
        index = layout.rank_indices(pack.cp_size, rank)
        for before, part in zip((None, *parts[:-1]), parts, strict=True):
            assert before is None or before.rows.stop == part.rows.start
            assert part.group_start <= rank < part.group_start + part.group_size
            held = {int(s) for s in np.searchsorted(starts, index[part.rows], side="right") - 1}
            assert held == set(part.entries_S.tolist()) - {int(s) for s in part.entries_S if layout.slots_S[s] == 0}


def test_parts_written_out():
    """cp 2: a sequence split over both ranks, whole ones on each, the padding entries (rank 0's empty)."""
    slots, size, start = np.array([8, 3, 1, 0, 1]), np.array([2, 1, 1, 1, 1]), np.array([0, 1, 0, 0, 1])
    assert [(p.group_start, p.group_size, p.rows, p.entries_S.tolist()) for p in rank_parts(slots, 2, 0, size, start)] == [
        (0, 2, slice(0, 4), [0]),
        (0, 1, slice(4, 5), [2]),
    ]
    assert [(p.group_size, p.rows) for p in rank_parts(np.array([8, 8]), 2, 1)] == [(2, slice(0, 8))]  # TE: one part
