"""benchmarks/train_throughput.py: every mode lays out exactly the step's tokens as it claims, and
--tiny runs end to end on the CPU with the same real tokens per step in every mode."""

from __future__ import annotations

import doctest
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from support.benchmarks import load_benchmark

tt = load_benchmark("train_throughput")

L = 32
CFG = replace(tt.TINY, pack_sizes=(L,), micro_tokens=2 * L, step_tokens=4 * L, warmup=0, steps=1)
"""2 packs of 32 per micro-batch, 2 micro-batches per step."""
LENGTHS = np.array([5, 31, 2, 17, 9, 32, 1, 12, 20, 3], dtype=np.int64)
STEP = tt.plan_step(LENGTHS, L)


def _step(lengths=LENGTHS):
    """The stream ids are 1..R, so every real token names its place in the step's stream."""
    total = int(lengths.sum())
    return np.arange(1, total + 1), np.arange(1, total + 1) + 1000


def _sequences(batch):
    """(real ids, slot width) of every sequence of a host THD batch."""
    cu, cu_padded = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
    ids = batch["input_ids"].tolist()
    return [
        (ids[cu_padded[s] : cu_padded[s] + cu[s + 1] - cu[s]], cu_padded[s + 1] - cu_padded[s])
        for s in range(len(cu) - 1)
    ]


def _documents(lengths=LENGTHS):
    ids, _ = _step(lengths)
    starts = np.cumsum(lengths) - lengths
    return sorted(ids[s : s + n].tolist() for s, n in zip(starts, lengths, strict=True))


@pytest.mark.parametrize("mode", tt.MODES)
def test_every_mode_carries_exactly_the_step_tokens(mode):
    ids, labels = _step()
    batches = tt.micro_batches(mode, STEP, ids, labels, L, CFG)
    real_ids = torch.cat([b["input_ids"][b["labels"] != -100] for b in batches])
    assert sorted(real_ids.tolist()) == ids.tolist()
    for b in batches:  # every real token keeps its own label; padding carries pad id 0 and label -100
        real = b["labels"] != -100
        assert (b["labels"][real] == b["input_ids"][real] + 1000).all()
        assert (b["input_ids"][~real] == 0).all() and bool((real == ~b["padding_mask"]).all())
    assert sum(tt.batch_counts(b)["real"] for b in batches) == int(LENGTHS.sum())


@pytest.mark.parametrize("mode", ["padding", "grouped", "packed"])
def test_document_modes_keep_every_document_whole(mode):
    ids, labels = _step()
    batches = tt.micro_batches(mode, STEP, ids, labels, L, CFG)
    assert sorted(real for b in batches for real, _ in _sequences(b)) == _documents()


def test_dynamic_padding_pads_each_example_to_the_longest_of_its_micro_batch():
    ids, labels = _step()
    batches = tt.micro_batches("padding", STEP, ids, labels, L, CFG)
    assert len(batches) == CFG.micro_batches  # B = ceil(10 / 2) = 5 examples each, in stream order
    groups = [LENGTHS[:5], LENGTHS[5:]]
    for b, group in zip(batches, groups, strict=True):
        widths = [w for _, w in _sequences(b)]
        assert widths == [int(group.max())] * 5
        assert [len(real) for real, _ in _sequences(b)] == group.tolist()
    assert batches[0]["max_seqlen"] == 31 and batches[0]["input_ids"].numel() == 5 * 31


def test_dynamic_padding_cuts_a_micro_batch_over_the_memory_cap_into_fewer_rows():
    lengths = np.array([32, 1, 1, 1, 1, 1, 1, 1], dtype=np.int64)  # 8 rows of 32 = 256 slots > 2 * 64
    cfg = replace(CFG, step_tokens=2 * L, pad_cap=2.0)  # one micro-batch of B = 8 examples, cap 128 slots
    ids, labels = _step(lengths)
    batches = tt.micro_batches("padding", tt.plan_step(lengths, L), ids, labels, L, cfg)
    assert [b["input_ids"].numel() for b in batches] == [4 * 32, 4 * 1]  # rows 0-3 (widest 32), rows 4-7
    assert all(b["input_ids"].numel() <= cfg.pad_cap * cfg.micro_tokens for b in batches)


def test_length_grouping_sorts_and_fills_micro_batches_up_to_their_slots():
    ids, labels = _step()
    batches = tt.micro_batches("grouped", STEP, ids, labels, L, CFG)
    seen = []
    for b in batches:
        seqs = _sequences(b)
        width = max(len(real) for real, _ in seqs)
        assert all(w == width for _, w in seqs) and b["input_ids"].numel() <= CFG.micro_tokens
        seen += [len(real) for real, _ in seqs]
    assert seen == sorted(LENGTHS.tolist(), reverse=True)


def test_naive_concatenation_has_one_sequence_per_row():
    ids, labels = _step()
    batches = tt.micro_batches("concat", STEP, ids, labels, L, CFG)
    rows = [seq for b in batches for seq in _sequences(b)]
    assert [w for _, w in rows] == [L] * len(rows)
    stream = [t for real, _ in rows for t in real]
    assert stream == ids.tolist()  # the documents back to back, boundaries ignored
    assert [len(real) for real, _ in rows] == [L] * 4 + [int(LENGTHS.sum()) - 4 * L]


def test_ideal_rows_are_full_single_sequences_without_padding():
    ids, labels = _step()
    batches = tt.micro_batches("ideal", STEP, ids, labels, L, CFG)
    for b in batches:
        assert torch.equal(b["cu_seqlens"], b["cu_seqlens_padded"]) and not b["padding_mask"].any()
    assert [len(real) for b in batches for real, _ in _sequences(b)] == [L] * 4 + [int(LENGTHS.sum()) - 4 * L]


def test_packed_micro_batches_are_whole_packs_of_the_bfd_plan():
    ids, labels = _step()
    batches = tt.micro_batches("packed", STEP, ids, labels, L, CFG)
    packs = len(tt.plan_packs(LENGTHS, L))  # 132 tokens: 5 packs of 32, 2 per micro-batch
    assert packs == 5 and [b["input_ids"].numel() for b in batches] == [2 * L, 2 * L, L]
    for b in batches:
        pairs = sum(len(real) * (len(real) + 1) // 2 for real, _ in _sequences(b))
        assert tt.batch_counts(b)["pairs"] == pairs


def test_steps_are_random_packs_of_one_plan_of_all_documents():
    pieces = np.random.default_rng(0).integers(1, L + 1, 500)
    plan = tt.plan_packs(pieces, L)
    packs = {tuple(sorted(pieces[plan[i]].tolist())) for i in range(len(plan))}
    steps = tt.draw_steps(pieces, L, 4, 6, np.random.default_rng(1))
    assert len(steps) == 6
    for step in steps:
        assert len(step.packs) == 4 and sorted(np.concatenate(step.packs).tolist()) == list(range(len(step.lengths_S)))
        for members in step.packs:  # each of the step's packs is one pack of the epoch's plan
            assert tuple(sorted(step.lengths_S[members].tolist())) in packs
    again = tt.draw_steps(pieces, L, 4, 6, np.random.default_rng(1))
    assert all(np.array_equal(a.lengths_S, b.lengths_S) for a, b in zip(steps, again, strict=True))
    with pytest.raises(ValueError, match=r"the lengths fill 1 packs of 32 tokens, fewer than the 4 of one step"):
        tt.draw_steps(np.array([3, 4]), L, 4, 1, np.random.default_rng(1))


def test_long_documents_are_split_and_counted():
    pieces, split = tt.split_documents(np.array([3, 70, 32]), 32)
    assert pieces.tolist() == [3, 32, 32, 6, 32] and split == 1


def test_lengths_files_are_checked(tmp_path):
    good = tmp_path / "good.npy"
    np.save(good, np.array([4, 0, 7, 0]))
    lengths, empty = tt.load_lengths(good)
    assert lengths.tolist() == [4, 7] and empty == 2
    np.save(tmp_path / "flat.npy", np.ones((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match=r"flat.npy: expected a 1-D integer array of document lengths"):
        tt.load_lengths(tmp_path / "flat.npy")
    np.save(tmp_path / "neg.npy", np.array([3, -1]))
    with pytest.raises(ValueError, match=r"neg.npy: document 1 has length -1; lengths must be >= 0"):
        tt.load_lengths(tmp_path / "neg.npy")


def test_config_refuses_micro_batches_that_cut_packs():
    with pytest.raises(
        ValueError, match=r"micro_tokens=100 is not a multiple of pack size 64; .* use micro_tokens=128"
    ):
        tt.ThroughputConfig(pack_sizes=(64,), micro_tokens=100, step_tokens=200)
    with pytest.raises(ValueError, match=r"step_tokens=300 is not a multiple of micro_tokens=128"):
        tt.ThroughputConfig(pack_sizes=(64,), micro_tokens=128, step_tokens=300)


def test_ratios_mark_targets_and_failed_modes():
    modes = {m: {"tokens_per_s": 100.0} for m in tt.MODES}
    modes["packed"]["tokens_per_s"] = 260.0
    modes["grouped"] = {"failed": "OutOfMemoryError: ..."}
    ratios = tt.ratios(modes)
    assert ratios["c/a"] == {"value": 2.6, "target": 2.5, "met": True}
    assert ratios["c/b"] == {"value": None, "target": 1.3, "met": None}
    assert ratios["c/e"]["met"] is True


def test_bf16_mixed_step_keeps_fp32_weights_and_moves_them():
    model = tt.Transformer(tt.TINY_MODEL, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    ids, labels = _step()
    batches = tt.micro_batches("packed", STEP, ids % 256, labels % 256, L, CFG)
    loss = tt.train_step(model, optimizer, batches, torch.device("cpu"), "bf16-mixed")
    assert loss.dtype == torch.float64 and torch.isfinite(loss)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_model_flops_count_useful_work_only():
    model = tt.Transformer(tt.TINY_MODEL, seed=0)
    params = sum(p.numel() for p in model.parameters())
    # tied embedding; per layer q and o 64x64, k and v 64x32, SwiGLU 3 x 64x192, 2 norms; final norm
    assert params == 256 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 192 + 2 * 64) + 64
    # 10 real tokens in sequences of 4 and 6: 10 + 21 causal pairs; 2 layers x 4 heads x 16 channels
    assert tt.step_flops(model, 10, 31) == 6 * params * 10 + 12 * 2 * 4 * 16 * 31


@pytest.mark.parametrize(
    ("name", "peak"),
    [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989e12), ("Tesla T4", None)],
)
def test_mfu_peaks_by_device_name(monkeypatch, name, peak):
    monkeypatch.setattr(tt.torch.cuda, "get_device_name", lambda device=None: name)
    assert tt.peak_flops(torch.device("cuda")) == peak
    assert tt.peak_flops(torch.device("cpu")) is None


def test_gpu_busy_time_is_the_union_of_device_intervals():
    class Event:
        def __init__(self, device_type, start, end):
            self.device_type, self.time_range = device_type, type("R", (), {"start": start, "end": end})()

    events = [Event("cuda", 0, 10), Event("cpu", 0, 100), Event("cuda", 5, 20), Event("cuda", 50, 60)]
    intervals = tt.device_intervals(events, "cuda")
    assert intervals == [(0, 10), (5, 20), (50, 60)]
    assert tt.busy_seconds(intervals) == pytest.approx(30e-6)


def test_docstring_examples():
    assert doctest.testmod(tt, optionflags=doctest.NORMALIZE_WHITESPACE).failed == 0


def test_a_failing_mode_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    lengths = tmp_path / "short.npy"
    np.save(lengths, np.random.default_rng(0).integers(1, 40, 300))
    real_micro_batches = tt.micro_batches

    def out_of_vocabulary(mode, *args, **kwargs):
        batches = real_micro_batches(mode, *args, **kwargs)
        if mode == "grouped":  # the embedding fails on it while training, as a kernel error would
            batches[0]["input_ids"][0] = tt.TINY_MODEL.vocab_size
        return batches

    monkeypatch.setattr(tt, "micro_batches", out_of_vocabulary)
    result = tt.run({"short": lengths}, replace(CFG, steps=2), torch.device("cpu"), say=lambda line: None)
    modes = result["runs"][0]["modes"]
    assert modes["grouped"]["failed"].startswith("IndexError: index out of range")
    assert all(len(modes[m]["step_seconds"]) == 2 for m in tt.MODES if m != "grouped")
    assert result["runs"][0]["ratios"]["c/b"]["value"] is None
    ratio_row = next(line for line in tt.markdown(result).splitlines() if line.startswith("| short | 32 | cpu |"))
    assert ratio_row.split(" | ")[4] == "not measured"  # c/b; c/a and c/e were measured
    assert "(b) length-grouped padding | cpu | failed: IndexError: index out of range" in tt.markdown(result)


@pytest.mark.slow
def test_tiny_run_writes_every_mode_with_equal_real_tokens(tmp_path, capsys):
    rng = np.random.default_rng(0)
    lengths = np.concatenate([np.rint(rng.lognormal(3.5, 1.0, 3000)).astype(np.int64), [0, 0, 900]])
    np.save(tmp_path / "sft.lengths.npy", lengths)
    out = tmp_path / "out"
    assert tt.main(["--tiny", "--lengths", str(tmp_path / "sft.lengths.npy"), "--out", str(out)]) == 0
    result = json.loads((out / "train_throughput.json").read_text())
    assert (out / "train_throughput.md").exists() and (out / "train_throughput.png").stat().st_size > 0
    assert result["device"] == "cpu" and result["precision"] == "fp32"
    assert [r["pack_size"] for r in result["runs"]] == [128, 256]
    for run in result["runs"]:
        assert run["data"] == "sft" and run["empty_documents"] == 2 and run["split_documents"] >= 1
        assert list(run["modes"]) == list(tt.MODES)
        real = {tuple(row["real_tokens_per_step"]) for row in run["modes"].values()}
        assert len(real) == 1 and len(next(iter(real))) == tt.TINY.steps
        assert run["modes"]["padding"]["padding"] > run["modes"]["packed"]["padding"]
        assert run["modes"]["ideal"]["padding"] == 0.0
        for row in run["modes"].values():
            assert row["tokens_per_s"] > 0 and row["mfu"] is None and row["peak_memory_bytes"] is None
        for name, ratio in run["ratios"].items():
            assert ratio["value"] > 0 and isinstance(ratio["met"], bool), name
    printed = capsys.readouterr().out
    assert "| sft | 128 | (c) thdpack packed THD | cpu |" in printed and "c/a (target >= 2.5)" in printed
