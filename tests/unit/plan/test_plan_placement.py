"""CpPlacement: the record, its validator, the per-rank token layout and the cost of each rank."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from placement_cases import placements

from thdpack.cp.partition import partition_from_lengths
from thdpack.plan.cp_cost import pairs_below, split_cost, te_slot, whole_limit
from thdpack.plan.placement import (
    CpLayout,
    CpPlacement,
    PackPlacement,
    group_options,
    group_sizes,
    placement_indices,
    slot_lengths,
)


def test_group_sizes_and_options():
    assert group_sizes(8) == (1, 2, 4, 8)
    assert group_sizes(12) == (1, 2, 4, 12)
    assert group_sizes(3) == (1, 3)
    size_O, start_O = group_options(8, (1, 8))
    assert size_O.tolist() == [8] + [1] * 8 and start_O.tolist() == [0, *range(8)]
    with pytest.raises(ValueError, match="group size 3 is not allowed for cp_size=4; valid: "):
        group_options(4, (3,))


@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.sampled_from([1, 2, 3, 4, 8]))
def test_every_sequence_split_over_all_ranks_is_te_partition(units, cp):
    """g = cp everywhere is exactly Transformer Engine's partition (partition_from_lengths)."""
    slots = np.array(units) * 2 * cp
    g = np.full(len(slots), cp)
    for rank in range(cp):
        assert placement_indices(slots, g, np.zeros_like(g), cp, rank).tolist() == (
            partition_from_lengths(slots, cp, rank).tolist()
        )


@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.sampled_from([2, 4, 8]))
def test_all_split_pack_without_tail_is_te_partition(units, cp):
    slots = np.array(units) * 2 * cp
    pack = PackPlacement(cp_size=cp, pack_size=int(slots.sum()), lengths_S=slots, group_size_S=np.full(len(slots), cp),
                         group_start_S=np.zeros(len(slots), int))  # fmt: skip
    layout = pack.layout()
    assert layout.slots_S[len(slots) :].tolist() == [0] * cp  # no tail padding
    for rank in range(cp):
        assert layout.rank_indices(cp, rank).tolist() == partition_from_lengths(slots, cp, rank).tolist()


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
            want = to_global[partition_from_lengths(sub_slots, g, j)]
            got = layout.rank_indices(pack.cp_size, rank)
            assert got[before : before + len(want)].tolist() == want.tolist()


def test_worked_example_of_the_design_note():
    """docs/design/cp_placement.md: cp 4, pack 48 (budget 12), sequences A..F of 10, 7, 5, 3, 2, 1."""
    pack = PackPlacement.from_groups(
        [10, 7, 5, 3, 2, 1], {(0, 4): [0], (2, 2): [1], (0, 1): [2], (1, 1): [3, 5], (2, 1): [4]},
        cp_size=4, pack_size=48,
    )  # fmt: skip
    layout = pack.layout()
    assert layout.slots_S.tolist() == [16, 8, 5, 3, 2, 1, 3, 4, 2, 4]
    assert layout.lengths_S.tolist() == [10, 7, 5, 3, 2, 1, 0, 0, 0, 0]
    assert layout.group_size_S.tolist() == [4, 2, 1, 1, 1, 1, 1, 1, 1, 1]
    assert layout.group_start_S.tolist() == [0, 2, 0, 1, 2, 1, 0, 1, 2, 3]
    assert pack.rank_tokens().tolist() == [9, 8, 10, 8]
    assert [layout.rank_indices(4, r).tolist() for r in range(4)] == [
        [0, 1, 14, 15, 24, 25, 26, 27, 28, 35, 36, 37],
        [2, 3, 12, 13, 29, 30, 31, 34, 38, 39, 40, 41],
        [4, 5, 10, 11, 16, 17, 22, 23, 32, 33, 42, 43],
        [6, 7, 8, 9, 18, 19, 20, 21, 44, 45, 46, 47],
    ]
    assert pack.as_plan().cp_padding_tokens == 7


def test_validator_names_pack_sequence_and_value():
    def plan(group_size, group_start, lengths=(4, 4), cp=4, pack_size=16):
        return CpPlacement(cp_size=cp, pack_size=pack_size, offsets=[0, len(lengths)], lengths=lengths,
                           group_size=group_size, group_start=group_start)  # fmt: skip

    with pytest.raises(ValueError, match=r"pack 0: sequence 1 of the pack is placed on a group of 3 ranks, which "
                                         r"does not divide cp_size=4; valid group sizes: 1, 2, 4"):  # fmt: skip
        plan([1, 3], [0, 0]).validate()
    with pytest.raises(ValueError, match="which is not a power of 2 below cp_size=12"):
        plan([6, 1], [0, 0], cp=12, pack_size=48).validate()
    with pytest.raises(ValueError, match=r"pack 0: sequence 0 of the pack \(dataset sequence 7\) is placed on "
                                         r"ranks 1..2 \(a group of 2 starting at rank 1\); a group of 2 must start "
                                         r"at a multiple of 2"):  # fmt: skip
        plan([2, 1], [1, 0]).validate(sequence_ids=np.array([7, 8]))
    with pytest.raises(ValueError, match=r"pack 0: rank 0 holds 8 tokens, over its budget of 4 \(pack_size=16 / "
                                         r"cp_size=4\)"):  # fmt: skip
        plan([1, 1], [0, 0]).validate()
    with pytest.raises(ValueError, match="sequence 1 of the pack has length 0"):
        plan([1, 1], [0, 1], lengths=(4, 0)).validate()
    plan([4, 1], [0, 3], pack_size=24).validate()  # 2 tokens each from the first, 4 more on rank 3: fits


def test_from_groups_rejects_sequences_placed_twice_never_or_unknown():
    with pytest.raises(ValueError, match=r"sequence 1 of the pack is placed twice: on ranks 0..0 and on ranks 1..1"):
        PackPlacement.from_groups([4, 2], {(0, 1): [0, 1], (1, 1): [1]}, cp_size=2, pack_size=8)
    with pytest.raises(ValueError, match=r"sequence 1 of the pack is placed never \(1 unplaced in all\)"):
        PackPlacement.from_groups([4, 2], {(0, 1): [0]}, cp_size=2, pack_size=8)
    with pytest.raises(ValueError, match=r"lists sequence 5, but the pack holds 2 sequences \(0..1\)"):
        PackPlacement.from_groups([4, 2], {(0, 1): [0, 5]}, cp_size=2, pack_size=8)


def test_record_checks_its_shape():
    with pytest.raises(ValueError, match="offsets must rise from 0 to the number of entries"):
        CpPlacement(cp_size=2, pack_size=8, offsets=[0, 3], lengths=[1, 1], group_size=[1, 1], group_start=[0, 0])
    with pytest.raises(ValueError, match="one group per entry"):
        CpPlacement(cp_size=2, pack_size=8, offsets=[0, 2], lengths=[1, 1], group_size=[1], group_start=[0, 0])
    with pytest.raises(ValueError, match="pack_size=9 is not a multiple of cp_size=2"):
        CpPlacement(cp_size=2, pack_size=9, offsets=[0, 1], lengths=[1], group_size=[1], group_start=[0])


@given(placements())
def test_rank_pairs_are_the_causal_pairs_of_each_rank_s_real_tokens(pack):
    """rank_costs('pairs'), token by token from the rank's indices."""
    layout = pack.layout()
    starts = np.repeat(np.cumsum(layout.slots_S) - layout.slots_S, layout.slots_S)
    position = np.arange(pack.pack_size) - starts
    real = position < np.repeat(layout.lengths_S, layout.slots_S)
    got = pack.as_plan().rank_costs("pairs")[0]
    for rank in range(pack.cp_size):
        index = layout.rank_indices(pack.cp_size, rank)
        assert got[rank] == int((position[index][real[index]] + 1).sum())
    assert int(got.sum()) == int(pairs_below(pack.lengths_S).sum())


@given(placements())
def test_rank_tiles_add_up_per_sequence(pack):
    got = pack.as_plan().rank_costs("tiles")[0]
    want = np.zeros(pack.cp_size, dtype=np.int64)
    for n, g, g0 in zip(pack.lengths_S, pack.group_size_S, pack.group_start_S, strict=True):
        if g == 1:
            want[g0] += -(-n // 128) * (-(-n // 128) + 1) // 2
        else:
            want[g0 : g0 + g] += split_cost(np.array([n]), slot_lengths(np.array([n]), np.array([g])), g, "tiles")[0]
    assert got.tolist() == want.tolist()


def test_te_tiles_of_one_long_sequence():
    """One 1024-token sequence, cp 2: chunk 256; step 0 a causal 512 x 512 tile (4 blocks: 10
    tiles), step 1 a 512 x 256 tile (8 tiles): 18 tiles on each rank."""
    te = CpPlacement.all_split(np.array([0, 1]), np.array([1024]), cp_size=2, pack_size=1024)
    assert te.rank_costs("tiles").tolist() == [[18, 18]]
    assert te.rank_tokens().tolist() == [[512, 512]]


def test_whole_limit_short_sequences_never_cost_more_whole():
    for cp in (2, 3, 4, 8, 16):
        m = np.arange(1, whole_limit(cp, "tiles") + 1)
        whole = -(-m // 128) * (-(-m // 128) + 1) // 2
        assert (whole <= split_cost(m, te_slot(m, cp), cp, "tiles").min(axis=1)).all()


def test_concat_gathers_groups_across_packs():
    a = PackPlacement(cp_size=2, pack_size=8, lengths_S=[4, 2], group_size_S=[2, 1], group_start_S=[0, 0]).layout()
    b = PackPlacement(cp_size=2, pack_size=8, lengths_S=[4], group_size_S=[2], group_start_S=[0]).layout()
    both = CpLayout.concat([a, b])
    # rank 0: chunk 0 and 3 of each split sequence (pack 0 at 0.., pack 1 at 8..), then its whole entries
    assert both.rank_indices(2, 0).tolist() == [0, 3, 8, 11, 4, 5, 12, 13]
