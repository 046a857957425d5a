"""thdpack.plan.cp_cost: the attention cost of each rank of a placement (tiles, pairs) and the
length below which a sequence never costs more whole."""

from __future__ import annotations

import numpy as np
from hypothesis import given

from thdpack.layout.placement import CpPlacement
from thdpack.layout.rules import round_up_to_cp, slot_lengths
from thdpack.plan.cp_cost import pairs_below, rank_costs, split_cost, whole_limit

from support.placement_cases import placements


@given(placements())
def test_rank_pairs_are_the_causal_pairs_of_each_rank_s_real_tokens(pack):
    """rank_costs('pairs'), token by token from the rank's indices."""
    layout = pack.layout()
    starts = np.repeat(np.cumsum(layout.slots_S) - layout.slots_S, layout.slots_S)
    position = np.arange(pack.pack_size) - starts
    real = position < np.repeat(layout.lengths_S, layout.slots_S)
    got = rank_costs(pack.as_plan(), "pairs")[0]
    for rank in range(pack.cp_size):
        index = layout.rank_indices(pack.cp_size, rank)
        assert got[rank] == int((position[index][real[index]] + 1).sum())
    assert int(got.sum()) == int(pairs_below(pack.lengths_S).sum())


@given(placements())
def test_rank_tiles_add_up_per_sequence(pack):
    got = rank_costs(pack.as_plan(), "tiles")[0]
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
    assert rank_costs(te, "tiles").tolist() == [[18, 18]]


def test_whole_limit_short_sequences_never_cost_more_whole():
    for cp in (2, 3, 4, 8, 16):
        m = np.arange(1, whole_limit(cp, "tiles") + 1)
        whole = -(-m // 128) * (-(-m // 128) + 1) // 2
        assert (whole <= split_cost(m, round_up_to_cp(m, cp), cp, "tiles").min(axis=1)).all()
