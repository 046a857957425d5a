"""Megatron-LM's schedulers, re-implemented: their rules on small written-out cases."""

from __future__ import annotations

import numpy as np
import pytest

from thdpack.perf.megatron import (
    dp_balanced,
    dynamic_cp,
    group_size_needed,
    lognormal_lengths,
    sample_tokens,
    scheduler_run,
)
from thdpack.perf.mesh import COMMS


def test_dp_balanced_packs_in_order_up_to_cp_ranks_of_tokens():
    # capacity 2 x 4096: [3000, 3000] | [3000, 500, 100] (7000 does not fit) | [7000]
    assert dp_balanced([3000, 3000, 3000, 500, 100, 7000], dp=1, cp=2, max_seqlen_per_rank=4096) == [
        [[0, 1]],
        [[2, 3, 4]],
        [[5]],
    ]


def test_dp_balanced_makes_the_pack_count_a_multiple_of_dp():
    # three packs for dp 2: the last pack holding several samples gives up its last one
    assert dp_balanced([3000, 3000, 3000, 500, 100, 7000], dp=2, cp=2, max_seqlen_per_rank=4096) == [
        [[0, 1], [2, 3]],
        [[5], [4]],
    ]
    # micro-batch i gives pack i * dp + d to data-parallel rank d
    hands = dp_balanced([8000] * 6, dp=3, cp=4, max_seqlen_per_rank=2048)
    assert hands == [[[0], [1], [2]], [[3], [4], [5]]]


def test_the_group_a_sample_needs():
    cap = 2048
    assert [group_size_needed(n, cap) for n in (100, 2048, 2049, 4096, 4097, 8192, 8193)] == [1, 1, 2, 2, 4, 4, 8]
    assert group_size_needed(100, cap, min_size=2) == 2


def test_dynamic_cp_long_sample_first_the_rest_in_the_next_micro_batch():
    # 5000 needs 4 ranks: micro-batch 0 holds it alone (nothing else fits: no free rank, no group of
    # size 1); micro-batch 1: 1500 and 1200 on ranks of their own (1500 + 1200 > 2048), 900 on a
    # third; the empty fourth rank doubles the first group (1500 on ranks 0-1)
    assert dynamic_cp([5000, 1500, 1200, 900], world=4, max_seqlen_per_rank=2048) == [
        [[0], [0], [0], [0]],
        [[1], [1], [2], [3]],
    ]


def test_dynamic_cp_fills_empty_ranks_by_doubling_the_smallest_groups():
    # 900 and 800 would share a rank (1700 <= 2048), but the empty rank 1 is lighter, so 800 takes
    # it; ranks 2 and 3 stay empty: the first group grows onto rank 1 (800 moves to rank 2), then
    # the second grows onto rank 3
    assert dynamic_cp([900, 800], world=4, max_seqlen_per_rank=2048) == [[[0], [0], [1], [1]]]


def test_dynamic_cp_refuses_a_sample_the_mesh_cannot_hold():
    with pytest.raises(ValueError, match="sample 1 has 9000 tokens, which needs a group of 8 ranks"):
        dynamic_cp([100, 9000], world=4, max_seqlen_per_rank=2048)


def test_samples_are_padded_as_megatrons_varlen_dataset_pads_them():
    # the length counts the EOD; after the label shift a sample has length - 1 inputs
    assert sample_tokens(np.array([8192, 130, 9]), 8).tolist() == [8192, 136, 8]
    assert sample_tokens(np.array([8192, 130, 9]), 128).tolist() == [8192, 256, 128]


def test_the_lognormal_mean_and_sigma_are_the_unclipped_distributions():
    draws = lognormal_lengths(2_000_000, low=1, high=10**12, seed=1)
    assert draws.mean() == pytest.approx(1024, rel=0.02)
    # the median is exp(mu) = mean x exp(-sigma^2 / 2): mean and median pin both parameters
    assert np.median(draws) == pytest.approx(1024 * np.exp(-(1.5**2) / 2), rel=0.01)
    clipped = lognormal_lengths(100_000, seed=1)
    assert clipped.min() == 128 and clipped.max() == 8192


def test_scheduler_runs_hold_the_scheduled_tokens():
    lengths = np.array([4001, 3001, 2001, 1001, 8001, 101, 201, 301])
    base = scheduler_run("dp_balanced", lengths, dp=1, cp=2, micro_batches=8, max_seqlen_per_rank=4096)
    assert set(base.group_size.tolist()) == {2} and set(base.group_comm.tolist()) == {COMMS.index("ring")}
    padded = sample_tokens(lengths, 4)
    assert base.tokens.sum() == pytest.approx(padded.sum())  # every rank holds half of each pack
    dcp = scheduler_run("dynamic_cp", lengths, dp=1, cp=2, micro_batches=8, max_seqlen_per_rank=4096)
    assert dcp.tokens.sum() == pytest.approx(sample_tokens(lengths, 4).sum())
    assert sorted(dcp.entry_length.tolist()) == sorted(padded.tolist())
    with pytest.raises(ValueError, match="unknown Megatron scheduler 'fifo'"):
        scheduler_run("fifo", lengths, dp=1, cp=2, micro_batches=8, max_seqlen_per_rank=4096)
