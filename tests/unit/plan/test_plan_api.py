"""plan_packs: invariants, written-out cases, overflow policies and every bad input."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from plan_reference import next_fit

from thdpack.plan import ALGORITHMS, plan_packs


def _slots(lengths, cp_size):
    multiple = 2 * cp_size if cp_size > 1 else 1
    return -(-np.asarray(lengths) // multiple) * multiple


@st.composite
def problems(draw, max_len=300):
    cp_size = draw(st.sampled_from([1, 1, 2, 3, 4]))
    multiple = 2 * cp_size if cp_size > 1 else 1
    pack_size = multiple * draw(st.integers(1, max(1, 256 // multiple)))
    lengths = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=120))
    return lengths, pack_size, cp_size


@given(
    problems(),
    st.sampled_from(ALGORITHMS),
    st.sampled_from(["drop", "truncate", "split"]),
    st.none() | st.integers(0, 1000),
)
def test_every_sequence_placed_once_and_no_pack_over_capacity(problem, algorithm, overflow, seed):
    lengths, pack_size, cp_size = problem
    if overflow == "drop" and min(lengths) > pack_size:
        with pytest.raises(ValueError, match=f"overflow='drop' dropped all {len(lengths)} sequences"):
            plan_packs(lengths, pack_size, algorithm=algorithm, cp_size=cp_size, overflow=overflow, seed=seed)
        return
    plan = plan_packs(lengths, pack_size, algorithm=algorithm, cp_size=cp_size, overflow=overflow, seed=seed)
    stats = plan.stats
    lengths = np.asarray(lengths)
    placed_tokens = np.zeros(len(lengths), dtype=np.int64)
    for i in range(len(plan)):
        idx, starts, used = plan.segments(i)
        assert _slots(used, cp_size).sum() <= pack_size  # CP-rounded slots fit the pack
        assert (starts + used <= lengths[idx]).all() and (used >= 1).all()
        np.add.at(placed_tokens, idx, used)
    too_long = lengths > pack_size
    if overflow == "drop":
        assert (placed_tokens[~too_long] == lengths[~too_long]).all() and (placed_tokens[too_long] == 0).all()
        assert stats.dropped_sequences == too_long.sum()
        assert stats.dropped_tokens == lengths[too_long].sum()
    elif overflow == "truncate":
        assert (placed_tokens == np.minimum(lengths, pack_size)).all()
        assert stats.truncated_tokens == (lengths - np.minimum(lengths, pack_size)).sum()
    else:  # split: every token placed exactly once
        assert (placed_tokens == lengths).all()
        assert stats.split_sequences == too_long.sum()
    assert stats.real_tokens == placed_tokens.sum()
    assert stats.capacity_tokens == len(plan) * pack_size
    assert stats.lower_bound_packs <= stats.num_packs
    assert stats.num_sequences == len(lengths) - stats.dropped_sequences


@given(problems(max_len=64), st.sampled_from(ALGORITHMS))
def test_whole_sequences_each_placed_exactly_once(problem, algorithm):
    lengths, pack_size, cp_size = problem
    lengths = [min(n, pack_size) for n in lengths]
    plan = plan_packs(lengths, pack_size, algorithm=algorithm, cp_size=cp_size)
    assert sorted(np.concatenate(list(plan)).tolist()) == list(range(len(lengths)))
    assert plan.entry_starts is None and plan.entry_lengths is None
    slots = _slots(lengths, cp_size)
    assert plan.stats.cp_padding_tokens == slots.sum() - sum(lengths)
    assert all(slots[p].sum() <= pack_size for p in plan)


@given(problems(max_len=64))
def test_sequential_is_next_fit_in_dataset_order(problem):
    lengths, pack_size, cp_size = problem
    lengths = [min(n, pack_size) for n in lengths]
    plan = plan_packs(lengths, pack_size, algorithm="sequential", cp_size=cp_size)
    assert [p.tolist() for p in plan] == next_fit(_slots(lengths, cp_size).tolist(), pack_size)


@given(problems(max_len=64), st.integers(1, 16))
def test_window_keeps_order_within_the_window(problem, window):
    lengths, pack_size, cp_size = problem
    lengths = [min(n, pack_size) for n in lengths]
    plan = plan_packs(lengths, pack_size, algorithm="window", cp_size=cp_size, window=window)
    firsts = [int(p[0]) for p in plan]
    assert firsts == sorted(firsts)  # packs come in the order of their first sequence
    for pack in plan:  # nothing jumps more than window - 1 places ahead of the pack's first sequence
        assert (pack >= pack[0]).all() and (pack - pack[0] < window).all()


@given(problems(max_len=64), st.sampled_from(["bfd", "ffd"]), st.integers(0, 10**6))
def test_same_seed_same_plan(problem, algorithm, seed):
    lengths, pack_size, cp_size = problem
    lengths = [min(n, pack_size) for n in lengths]
    a = plan_packs(lengths, pack_size, algorithm=algorithm, cp_size=cp_size, seed=seed)
    b = plan_packs(lengths, pack_size, algorithm=algorithm, cp_size=cp_size, seed=seed)
    assert np.array_equal(a.indices, b.indices) and np.array_equal(a.offsets, b.offsets)


def test_seed_reshuffles_pairings_but_not_quality():
    lengths = np.random.default_rng(0).integers(1, 400, 2000)
    plain = plan_packs(lengths, 1024)
    seeded = [plan_packs(lengths, 1024, seed=s) for s in (1, 2)]
    assert not np.array_equal(seeded[0].indices, seeded[1].indices)
    assert not np.array_equal(plain.indices, seeded[0].indices)
    assert {len(plain), len(seeded[0]), len(seeded[1])} == {len(plain)}


def test_written_out_cases():
    lengths = [5, 3, 6, 2, 4]
    assert [p.tolist() for p in plan_packs(lengths, 10)] == [[2, 4], [0, 1, 3]]
    assert [p.tolist() for p in plan_packs(lengths, 10, algorithm="ffd")] == [[2, 4], [0, 1, 3]]
    assert [p.tolist() for p in plan_packs(lengths, 10, algorithm="sequential")] == [[0, 1], [2, 3], [4]]
    # window 3: pack 0 sees sequences 0-2 (3 fits after 5), pack 1 sees 2-4 (4 fits after 6)
    assert [p.tolist() for p in plan_packs(lengths, 10, algorithm="window", window=3)] == [
        [0, 1],
        [2, 4],
        [3],
    ]
    # cp_size 2: slots are multiples of 4 -> 8, 4, 8, 4, 4
    plan = plan_packs(lengths, 16, cp_size=2)
    assert [p.tolist() for p in plan] == [[0, 2], [1, 3, 4]]
    assert (plan.stats.real_tokens, plan.stats.cp_padding_tokens, plan.stats.tail_padding_tokens) == (
        20,
        8,
        4,
    )


def test_overflow_written_out():
    plan = plan_packs([3, 10, 4], 4, overflow="split", algorithm="sequential")
    segments = [tuple(a.tolist() for a in plan.segments(i)) for i in range(len(plan))]
    assert segments == [([0], [0], [3]), ([1], [0], [4]), ([1], [4], [4]), ([1], [8], [2]), ([2], [0], [4])]
    plan = plan_packs([3, 10, 4], 4, overflow="truncate", algorithm="sequential")
    assert [tuple(a.tolist() for a in plan.segments(i)) for i in range(len(plan))] == [
        ([0], [0], [3]),
        ([1], [0], [4]),
        ([2], [0], [4]),
    ]
    assert (plan.stats.truncated_sequences, plan.stats.truncated_tokens) == (1, 6)
    plan = plan_packs([3, 10, 4], 4, overflow="drop")
    assert sorted(np.concatenate(list(plan)).tolist()) == [0, 2]
    assert (plan.stats.dropped_sequences, plan.stats.dropped_tokens) == (1, 10)
    assert re.search(r"dropped \(overflow\)\s+1 sequences, 10 tokens", str(plan.stats))


def test_accepts_lists_numpy_torch_and_integral_floats():
    import torch

    want = plan_packs([5, 3, 6], 10).indices
    for lengths in (np.array([5, 3, 6], dtype=np.int32), torch.tensor([5, 3, 6]), [5.0, 3.0, 6.0]):
        assert np.array_equal(plan_packs(lengths, 10).indices, want)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"lengths": []}, ValueError, "lengths is empty: there is nothing to pack"),
        (
            {"lengths": [3, 0, 2]},
            ValueError,
            "sequence 1 has length 0; every sequence needs at least 1 token",
        ),
        ({"lengths": [3, 2, -4]}, ValueError, "sequence 2 has length -4"),
        ({"lengths": [3, 2.5]}, ValueError, r"sequence 1 has non-integer length 2\.5"),
        ({"lengths": [3, float("nan")]}, ValueError, "sequence 1 has non-integer length nan"),
        ({"lengths": ["3", "4"]}, TypeError, "lengths must be integers, got dtype <U1"),
        ({"lengths": [True, False]}, TypeError, "lengths must be integers, got booleans"),
        (
            {"lengths": [[3, 4]]},
            ValueError,
            r"lengths must be 1-D \(one length per sequence\), got shape \(1, 2\)",
        ),
        ({"pack_size": 0}, ValueError, "pack_size must be >= 1, got 0"),
        ({"pack_size": 8.0}, TypeError, "pack_size must be an integer, got 8.0"),
        ({"cp_size": 0}, ValueError, "cp_size must be >= 1, got 0"),
        (
            {"pack_size": 20, "cp_size": 4},
            ValueError,
            "pack_size=20 is not a multiple of 2\\*cp_size=8; .* use pack_size=24 or 16",
        ),
        ({"pack_size": 6, "cp_size": 4}, ValueError, "use pack_size=8$"),
        (
            {"algorithm": "greedy"},
            ValueError,
            "unknown algorithm 'greedy'; valid: bfd, ffd, sequential, window",
        ),
        (
            {"overflow": "wrap"},
            ValueError,
            "unknown overflow policy 'wrap'; valid: error, drop, truncate, split",
        ),
        ({"seed": -1}, ValueError, "seed must be >= 0, got -1"),
        ({"window": 0}, ValueError, "window must be >= 1, got 0"),
        ({"improve": "yes"}, TypeError, "improve must be True or False, got 'yes'"),
        (
            {"lengths": [3, 20, 30], "pack_size": 16},
            ValueError,
            r"sequence 1 has 20 tokens, over pack_size=16 \(2 sequences in total\); use overflow='split', "
            r"'truncate' or 'drop', or a larger pack_size",
        ),
    ],
)
def test_bad_input_is_named(kwargs, error, message):
    args = {"lengths": [3, 4], "pack_size": 8, **kwargs}
    with pytest.raises(error, match=message):
        plan_packs(args.pop("lengths"), args.pop("pack_size"), **args)


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        (np.array([3.0, 1e30]), r"sequence 1 has length 1e\+30, over the largest length thdpack plans"),
        (np.array([3, 2**63 + 5], dtype=np.uint64), "sequence 1 has length 9223372036854775813, over the largest"),
        (np.array([2**41, 3]), "sequence 0 has length 2199023255552, over the largest length"),
    ],
)
def test_huge_lengths_are_reported_with_their_real_value(lengths, message):
    with pytest.raises(ValueError, match=message):
        plan_packs(lengths, 8)


def test_a_pack_size_over_the_limit_is_refused():
    with pytest.raises(ValueError, match=r"pack_size=2,199,023,255,552 is over the largest pack thdpack plans"):
        plan_packs([3, 4], 2**41)


@pytest.mark.parametrize("pack_size", [10**9, 2**24, 2**40])
@pytest.mark.parametrize("algorithm", ["bfd", "ffd", "sequential", "window"])
def test_memory_follows_the_data_not_the_pack_size(pack_size, algorithm):
    """Two sequences in a 1e9-token pack used to allocate pack_size-long arrays (7.45 GiB)."""
    import tracemalloc

    tracemalloc.start()
    plan = plan_packs([3, 4], pack_size, algorithm=algorithm)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20, f"{peak / 2**20:.1f} MiB for two sequences"
    assert [sorted(p.tolist()) for p in plan] == [[0, 1]]
    assert plan.stats.lower_bound_packs == 1 and plan.stats.capacity_tokens == pack_size


@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.sampled_from(["bfd", "ffd"]), st.integers(0, 3))
def test_a_pack_larger_than_everything_gives_the_plan_of_the_exact_size(lengths, algorithm, extra):
    """The engine runs on min(pack, total): the same packs, in the same order, as without the clamp."""
    total = sum(lengths)
    exact = plan_packs(lengths, total, algorithm=algorithm, seed=1)
    larger = plan_packs(lengths, total * (extra + 1) + extra, algorithm=algorithm, seed=1)
    assert [p.tolist() for p in larger] == [p.tolist() for p in exact]
