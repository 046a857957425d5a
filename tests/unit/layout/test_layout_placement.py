"""thdpack.layout.placement: the placement record (CpPlacement, PackPlacement), its checks, its layout."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from thdpack.layout.entries import CpLayout
from thdpack.layout.placement import CpPlacement, PackPlacement
from thdpack.layout.ranks import rank_indices


@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.sampled_from([2, 4, 8]))
def test_all_split_pack_without_tail_is_te_partition(units, cp):
    slots = np.array(units) * 2 * cp
    pack = PackPlacement(cp_size=cp, pack_size=int(slots.sum()), lengths_S=slots, group_size_S=np.full(len(slots), cp),
                         group_start_S=np.zeros(len(slots), int))  # fmt: skip
    layout = pack.layout()
    assert layout.slots_S[len(slots) :].tolist() == [0] * cp  # no tail padding
    for rank in range(cp):
        assert layout.rank_indices(cp, rank).tolist() == rank_indices(slots, cp, rank).tolist()


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


def test_concat_gathers_groups_across_packs():
    a = PackPlacement(cp_size=2, pack_size=8, lengths_S=[4, 2], group_size_S=[2, 1], group_start_S=[0, 0]).layout()
    b = PackPlacement(cp_size=2, pack_size=8, lengths_S=[4], group_size_S=[2], group_start_S=[0]).layout()
    both = CpLayout.concat([a, b])
    # rank 0: chunk 0 and 3 of each split sequence (pack 0 at 0.., pack 1 at 8..), then its whole entries
    assert both.rank_indices(2, 0).tolist() == [0, 3, 8, 11, 4, 5, 12, 13]


def test_te_layout_record_tokens():
    te = CpPlacement.all_split(np.array([0, 1]), np.array([1024]), cp_size=2, pack_size=1024)
    assert te.rank_tokens().tolist() == [[512, 512]]
    assert (te.group_size == 2).all() and te.cp_padding_tokens == 0
