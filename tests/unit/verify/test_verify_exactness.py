"""The exactness harness in one process (dp 1 x cp 1; CP and DP are in tests/distributed): its
batches, its step against the independent oracle, and the faults it plants."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from thdpack.cp.topology import CpTopology
from thdpack.models import ModelConfig, Transformer
from thdpack.verify.exactness import (
    BASE_LENGTHS,
    StepSpread,
    baseline_errors,
    differences,
    global_micro_batches,
    make_samples,
    pack_size_for,
    packed_step,
    sample_lengths,
    unpacked_step,
)

from support.model_oracle import compare, oracle_step

CONFIG = ModelConfig.preset("tiny")
ALONE = CpTopology.single()


def _setup(spread: StepSpread):
    lengths = sample_lengths(spread)
    samples = make_samples(lengths, CONFIG.vocab_size, seed=0)
    return samples, global_micro_batches(samples, spread, pack_size_for(lengths, spread.cp_size))


def _model() -> Transformer:
    return Transformer(CONFIG, seed=1, dtype=torch.float64)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"dp_size": 0}, r"dp_size must be >= 1, got 0"),
        ({"reduction": "mean"}, r"unknown reduction 'mean'; valid: 'token_mean', 'sequence_mean'"),
        ({"fault": "typo"}, r"unknown fault 'typo'; valid: 'none', 'cross_sequence_attention'"),
        ({"fault": "foreign_shard"}, r"fault 'foreign_shard' only exists under context parallelism; use cp_size >= 2"),
    ],
)
def test_layout_checks(fields, match):
    with pytest.raises(ValueError, match=match):
        StepSpread(**fields)


@pytest.mark.parametrize(("dp_size", "cp_size"), [(1, 1), (2, 2), (4, 3)])
def test_micro_batches_hold_every_sample_once_with_the_edge_cases(dp_size, cp_size):
    spread = StepSpread(dp_size=dp_size, cp_size=cp_size)
    lengths = sample_lengths(spread)
    assert 1 in lengths and 2 * cp_size in lengths
    samples, batches = _setup(spread)
    assert len(batches) == dp_size and all(len(steps) == 2 for steps in batches)
    placed, tails, tokens = [], 0, []
    pack_size = pack_size_for(lengths, cp_size)
    for thd in (thd for steps in batches for thd in steps):
        real = ~thd["padding_mask"]
        placed += sorted(set(thd["sequence_index"][real].tolist()))
        slots = torch.diff(thd["cu_seqlens_padded"].long())
        assert bool((slots % (2 * cp_size if cp_size > 1 else 1) == 0).all())
        # tail padding: a pack whose last slot is wider than its CP rounding needs
        ends = torch.arange(pack_size, thd["input_ids"].shape[0] + 1, pack_size)
        tails += int(real[ends - 1].logical_not().sum())
        tokens.append(int(real.sum()))
        for s in set(thd["sequence_index"][real].tolist()):
            ids = thd["input_ids"][real & (thd["sequence_index"] == s)]
            assert ids.tolist() == samples[s]["input_ids"].tolist()
    assert sorted(placed) == list(range(len(samples)))
    assert tails > 0, "no pack ends in padding"
    assert len(set(tokens)) > 1, "every micro-batch has as many tokens: the loss normalisation would not be tested"


def test_too_few_packs_for_the_layout():
    samples = make_samples([3, 4], CONFIG.vocab_size, seed=0)
    with pytest.raises(
        ValueError, match=r"1 packs for 4 \(micro-step, DP rank\) slots; use more samples or fewer ranks"
    ):
        global_micro_batches(samples, StepSpread(dp_size=2), 24)


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
def test_packed_step_and_harness_reference_equal_the_oracle(reduction):
    spread = StepSpread(reduction=reduction)
    samples, batches = _setup(spread)
    oracle = oracle_step(_model(), samples, reduction)
    errors = compare([packed_step(_model(), batches[0], spread, ALONE)], oracle)
    assert max(errors.values()) <= 1e-10, errors
    reference = unpacked_step(_model(), samples, reduction)
    assert abs(reference.loss - oracle["loss"]) <= 1e-12
    assert max(float((reference.grads[n] - g).abs().max()) for n, g in oracle["grads"].items()) <= 1e-12
    diffs = differences(packed_step(_model(), batches[0], spread, ALONE), reference)
    assert set(diffs) == {"loss", "logits"} | {f"grad {n}" for n, _ in _model().named_parameters()}
    assert max(diffs.values()) <= 1e-10


@pytest.mark.parametrize(
    ("fault", "quantity"),
    [("cross_sequence_attention", "logits"), ("mean_of_means", "loss"), ("mean_of_means", "grads")],
)
def test_planted_faults_are_caught(fault, quantity):
    spread = StepSpread(fault=fault)
    samples, batches = _setup(spread)
    errors = compare([packed_step(_model(), batches[0], spread, ALONE)], oracle_step(_model(), samples, "token_mean"))
    assert errors[quantity] > 1e-4, errors


def test_baseline_errors_of_bf16_autocast():
    samples = make_samples(BASE_LENGTHS[:4], CONFIG.vocab_size, seed=0)
    model = Transformer(CONFIG, seed=1)
    reference = unpacked_step(model, samples, "token_mean")
    plain = unpacked_step(model, samples, "token_mean", autocast_dtype=torch.bfloat16)
    errors = baseline_errors(plain, reference)
    assert errors["loss"] >= abs(plain.loss - reference.loss)  # the error scale bounds the scalar error
    assert 1e-5 < errors["logits"] < 1e-1  # bf16-sized: rounding, not a bug
    assert baseline_errors(reference, reference) == dict.fromkeys(errors, 0.0)
    assert np.isclose(sum(float(x.sum()) for x in reference.weighted_token_losses), reference.loss)


def test_verify_runs_the_trainers_own_step(monkeypatch):
    """packed_step is thdpack.train.forward_backward's prepare_micro_batches + forward_backward, not a twin."""
    import thdpack.train.forward_backward as step
    import thdpack.verify.exactness as exactness

    calls = []
    for name in ("prepare_micro_batches", "forward_backward"):
        real = getattr(step, name)
        monkeypatch.setattr(
            exactness, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k)
        )
    spread = StepSpread(micro_steps=2)
    samples = make_samples(sample_lengths(spread), 64, seed=0)
    batches = global_micro_batches(samples, spread, pack_size_for(sample_lengths(spread), 1))
    packed_step(_model(), batches[0], spread, ALONE)
    assert calls == ["prepare_micro_batches", "forward_backward"]


def test_the_step_counts_its_loss_tokens_in_the_denominators_collective(monkeypatch):
    """One all-reduce per step gives both the denominator and the loss tokens the trainer logs."""
    import thdpack.loss as loss_module

    reductions = []
    real = loss_module._all_reduce_sum
    monkeypatch.setattr(loss_module, "_all_reduce_sum", lambda t, g: reductions.append(t.shape) or real(t, g))
    labels = [torch.tensor([1, 2, -100]), torch.tensor([0, -100, -100, 4])]
    weights = [torch.tensor([0.5, 0.5, 0.0]), torch.tensor([1.0, 0.0, 0.0, 1.0])]
    step = loss_module.StepLoss.begin(labels, topology=ALONE, micro_batch_weights=weights)
    assert reductions == [torch.Size([2])]
    assert (float(step.denominator), int(step.loss_tokens)) == (3.0, 4)
