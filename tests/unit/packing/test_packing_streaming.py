"""thdpack.packing.streaming: bounded-buffer best-fit packing of a stream, its stats, exact resume."""

from __future__ import annotations

import dataclasses
import inspect
import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thdpack.packing.runtime import PackingRuntime
from thdpack.packing.streaming import StreamingPacker, StreamingPackerConfig
from thdpack.testing import assert_resumable

from support.pack_checks import check_packs, unique_samples


class StatefulSource:
    """An iterable that checkpoints its own position (like StatefulDataLoader / HF IterableDataset)."""

    def __init__(self, samples):
        self.samples, self.position = samples, 0

    def __iter__(self):
        while self.position < len(self.samples):
            self.position += 1
            yield self.samples[self.position - 1]

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=30),
    cp_size=st.sampled_from([1, 2, 4]),
    pack_units=st.integers(1, 3),
    buffer_size=st.integers(1, 8),
    overflow=st.sampled_from(["drop", "truncate", "split"]),
    labels=st.booleans(),
    loss_mask=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_stream_packs_conserve_tokens(lengths, cp_size, pack_units, buffer_size, overflow, labels, loss_mask, seed):
    pack_size = 8 * pack_units
    samples = unique_samples(lengths, np.random.default_rng(seed), labels=labels, loss_mask=loss_mask)
    packer = StreamingPacker(iter(samples), pack_size, cp_size=cp_size, buffer_size=buffer_size, overflow=overflow)
    packs = list(packer)
    check_packs(packs, samples, pack_size, cp_size, 0, overflow)
    stats = packer.stats
    long = [n for n in lengths if n > pack_size]
    assert stats.num_packs == len(packs) >= stats.lower_bound_packs
    assert stats.real_tokens == sum(int(p["seq_lens"].sum()) for p in packs)
    assert stats.cp_padding_tokens + stats.tail_padding_tokens + stats.real_tokens == len(packs) * pack_size
    assert stats.num_entries == sum(len(p["seq_lens"]) for p in packs)
    assert stats.max_sequences_per_pack == max((len(p["seq_lens"]) for p in packs), default=0)
    if overflow == "drop":
        assert (stats.dropped_sequences, stats.dropped_tokens) == (len(long), sum(long))
    elif overflow == "truncate":
        assert stats.truncated_tokens == sum(n - pack_size for n in long)
    else:
        assert stats.split_sequences == len(long) and stats.num_sequences == len(lengths)


def test_worked_example_and_bounded_wait():
    samples = [{"input_ids": [i] * n} for i, n in enumerate((5, 2, 6, 3, 4, 1, 7), start=1)]
    packs = list(StreamingPacker(samples, 8, buffer_size=3))
    # buffer [5,2,6]: oldest 5, best fit 2 | buffer [6,3,4]: 6 (nothing fits) | [3,4,1]: 3+4+1 | [7]
    assert [p["seq_lens"].tolist() for p in packs] == [[5, 2], [6], [3, 4, 1], [7]]
    pack_of = {i: k for k, p in enumerate(packs) for i in set(p["input_ids"].tolist()) - {0}}
    # the oldest buffered sample always opens the next pack: sample i (1-based) leaves by pack i-1
    assert all(pack_of[i] <= i - 1 for i in pack_of)


def test_efficiency_close_to_offline_on_lognormal_lengths():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.0, 1.0, 3000).astype(int) + 1, 1, 1024)
    packer = StreamingPacker(({"input_ids": [1] * int(n)} for n in lengths), 1024, buffer_size=256)
    for _ in packer:
        pass
    assert packer.stats.efficiency > 0.99 and packer.stats.packs_over_lower_bound < 1.01


def _seq_lens(lengths, pack_size, buffer_size):
    packer = StreamingPacker([{"input_ids": [1] * n} for n in lengths], pack_size, buffer_size=buffer_size)
    return [p["seq_lens"].tolist() for p in packer], packer.stats


def test_exact_fills_close_the_gaps_best_fit_leaves():
    # best fit: [2,4] [3,4] [3,4] [4]; the exact fill closes 2's room of 6 with 3 + 3
    packs, stats = _seq_lens([2, 4, 3, 4, 3, 4, 4], 8, buffer_size=7)
    assert packs == [[2, 3, 3], [4, 4], [4, 4]]
    assert stats.num_packs == stats.lower_bound_packs == 3 and stats.optimal


def test_gaps_stay_open_while_long_entries_abound():
    # three entries over half a pack and three short ones: the short ones would run out, so the
    # pack is best fit's [6,3] (room 1 left), not [6,2,2]
    assert _seq_lens([6, 3, 2, 2, 6, 6], 10, buffer_size=6)[0] == [[6, 3], [2, 6, 2], [6]]
    # one long entry and three short ones: the gap is closed (the 3 swapped for 2 + 2)
    assert _seq_lens([6, 3, 2, 2], 10, buffer_size=4)[0] == [[6, 2, 2], [3]]


@settings(max_examples=12)
@given(stop_after=st.integers(0, 12), stateful=st.booleans(), overflow=st.sampled_from(["split", "truncate"]))
def test_resume_anywhere(stop_after, stateful, overflow):
    rng = np.random.default_rng(1)
    samples = unique_samples(rng.integers(1, 40, 60).tolist(), rng, labels=True, loss_mask=False)

    def make():
        source = StatefulSource(samples) if stateful else samples
        return StreamingPacker(source, 16, cp_size=2, buffer_size=5, overflow=overflow)

    assert_resumable(make, stop_after)


def test_a_restored_state_is_saved_again_before_iterating():
    samples = [{"input_ids": [1] * n} for n in (3, 4, 5, 6, 7)]
    packer = StreamingPacker(StatefulSource(samples), 8, buffer_size=2)
    next(iter(packer))
    state = packer.state_dict()
    restored = StreamingPacker(StatefulSource(samples), 8, buffer_size=2)
    restored.load_state_dict(state)
    again = restored.state_dict()
    assert again["source"] == state["source"] == {"position": 2} and again["consumed"] == 2


def test_state_survives_torch_save_with_weights_only():
    samples = [{"input_ids": list(range(1, n + 1))} for n in (5, 9, 3, 7, 2, 6)]
    packer = StreamingPacker(samples, 8, buffer_size=3, overflow="split")
    it = iter(packer)
    head = [next(it), next(it)]
    buffer = io.BytesIO()
    torch.save(packer.state_dict(), buffer)
    buffer.seek(0)
    resumed = StreamingPacker(samples, 8, buffer_size=3, overflow="split")
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    rest = list(resumed)
    full = list(StreamingPacker(samples, 8, buffer_size=3, overflow="split"))
    assert [p["input_ids"].tolist() for p in head + rest] == [p["input_ids"].tolist() for p in full]
    assert resumed.stats.num_packs == len(full)


def test_a_finished_stream_starts_a_new_pass():
    samples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
    packer = StreamingPacker(samples, 4)
    first, second = list(packer), list(packer)
    assert [p["input_ids"].tolist() for p in first] == [p["input_ids"].tolist() for p in second]
    assert packer.stats.num_packs == 2  # stats of the current pass


def test_errors():
    with pytest.raises(ValueError, match="sequence 1 has 9 tokens, over pack_size=8; use overflow='split'"):
        list(StreamingPacker([{"input_ids": [1]}, {"input_ids": [1] * 9}], 8))
    with pytest.raises(ValueError, match="buffer_size must be >= 1, got 0"):
        StreamingPacker([], 8, buffer_size=0)
    with pytest.raises(ValueError, match="unknown overflow policy 'wrap'; valid: error, drop, truncate, split"):
        StreamingPacker([], 8, overflow="wrap")
    with pytest.raises(ValueError, match=r"pack_size=8 is not a multiple of 2\*cp_size=6"):
        StreamingPacker([], 8, cp_size=3)
    with pytest.raises(TypeError, match=r"pad_id must be an integer token id, got 0\.5"):
        StreamingPacker([], 8, pad_id=0.5)
    with pytest.raises(TypeError, match="sample 0: input_ids must hold integers"):
        list(StreamingPacker([{"input_ids": ["a"]}], 8))
    with pytest.raises(TypeError, match=r"pack_size must be an integer, got 8\.0"):
        StreamingPacker([], 8.0)


def test_the_config_takes_the_runs_typed_runtime_beside_it():
    samples = [{"input_ids": [1] * n} for n in (3, 4, 5, 6)]
    config = StreamingPackerConfig(pack_size=8, buffer_size=2)
    built = [p["input_ids"].tolist() for p in config.build(samples, PackingRuntime(cp_size=2, pad_id=9))]
    assert built == [p["input_ids"].tolist() for p in StreamingPacker(samples, 8, buffer_size=2, cp_size=2, pad_id=9)]
    with pytest.raises(TypeError, match="unexpected keyword argument 'overflow'"):
        config.build(samples, overflow="split")


def test_the_keywords_are_every_setting_and_the_runtime_values_it_reads():
    names = {f.name for f in dataclasses.fields(StreamingPackerConfig)}
    assert set(inspect.signature(StreamingPacker).parameters) == {"source", "cp_size", "pad_id"} | names
    with pytest.raises(TypeError, match=r"StreamingPacker\(\) got an unexpected keyword argument 'dp_size'"):
        StreamingPacker([], 8, dp_size=2)  # the source is sharded per DP rank, not the packer


def test_resume_errors():
    samples = [{"input_ids": [1] * n} for n in (3, 4, 5, 6)]
    packer = StreamingPacker(samples, 8, buffer_size=2)
    next(iter(packer))
    state = packer.state_dict()
    with pytest.raises(ValueError, match=r"other settings \(buffer_size: saved 2, now 3\)"):
        StreamingPacker(samples, 8, buffer_size=3).load_state_dict(state)
    with pytest.raises(ValueError, match="saved without a source state_dict, but this source has state_dict"):
        StreamingPacker(StatefulSource(samples), 8, buffer_size=2).load_state_dict(state)
    short = StreamingPacker(samples[:1], 8, buffer_size=2)
    short.load_state_dict(state)
    with pytest.raises(ValueError, match="the source ended after 1 samples while skipping the 2 consumed"):
        next(iter(short))


@pytest.mark.parametrize("overflow", ["drop", "truncate", "split"])
def test_overflow_counts_are_plan_packs_counts(overflow):
    """The streaming packer applies the planner's overflow rule: the same counts on the same lengths."""
    from thdpack.plan import plan_packs

    lengths = [3, 20, 7, 9, 33, 1, 16, 17]
    stream = [{"input_ids": list(range(1, n + 1))} for n in lengths]
    packer = StreamingPacker(stream, 16, buffer_size=4, overflow=overflow)
    list(packer)
    planned = plan_packs(lengths, 16, overflow=overflow).stats
    for key in ("dropped_sequences", "dropped_tokens", "truncated_sequences", "truncated_tokens", "split_sequences"):
        assert getattr(packer.stats, key) == getattr(planned, key), key
    assert (packer.stats.num_sequences, packer.stats.num_entries) == (planned.num_sequences, planned.num_entries)
    assert packer.stats.real_tokens == planned.real_tokens


def test_a_state_from_before_the_stats_rework_is_refused_clearly():
    packer = StreamingPacker([{"input_ids": [1, 2]}], 8)
    state = packer.state_dict()
    state["counters"] = state.pop("totals")
    with pytest.raises(ValueError, match="saved by an older thdpack"):
        StreamingPacker([{"input_ids": [1, 2]}], 8).load_state_dict(state)
