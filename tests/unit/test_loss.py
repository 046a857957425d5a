"""Packed cross-entropy: written-out numbers, the mean-of-means pitfall, weights, validation."""

from __future__ import annotations

import math

import pytest
import torch

from thdpack.cp.topology import CpTopology
from thdpack.loss import (
    StepLoss,
    count_loss_tokens,
    cross_entropy_sum,
    global_loss_denominator,
    loss_weights,
    packed_cross_entropy,
)
from thdpack.thd.meta import ThdMeta

ONE = CpTopology.single()
LOG2 = 0.6931471805599453
LOG4_3 = 0.28768207245178085  # CE of logits (log 3, 0) for label 0: -log(3/4)


def two_micro_batches():
    """Micro-batch 1: one loss token with CE log 2. Micro-batch 2: three with CE log(4/3), one ignored."""
    even = torch.zeros(1, 2, dtype=torch.float64)
    skewed = torch.tensor([[math.log(3), 0.0]] * 4, dtype=torch.float64)
    return [(even, torch.tensor([1])), (skewed, torch.tensor([0, 0, -100, 0]))]


def test_cross_entropy_sum_written_out():
    logits_TV = torch.zeros(4, 3, dtype=torch.float64)
    assert cross_entropy_sum(logits_TV, torch.tensor([1, -100, 2, 0])).item() == pytest.approx(
        3.295836866004329, abs=1e-12
    )  # 3 * log 3
    weights_T = torch.tensor([0.5, 7.0, 1.0, 0.0], dtype=torch.float64)
    assert cross_entropy_sum(logits_TV, torch.tensor([1, -100, 2, 0]), weights_T).item() == pytest.approx(
        1.5 * 1.0986122886681098, abs=1e-12
    )


def test_global_token_mean_is_not_the_mean_of_means():
    mbs = two_micro_batches()
    step = StepLoss.begin([labels for _, labels in mbs], topology=ONE)
    assert step.denominator.item() == 4.0
    for logits, labels in mbs:
        step(logits, labels)
    # the unpacked token mean: (log 2 + 3 log(4/3)) / 4
    assert step.value().item() == pytest.approx(0.38904834947882194, abs=1e-12)
    # what a per-micro-batch mean averaged over micro-steps reports: (log 2 + log(4/3)) / 2
    naive = sum(cross_entropy_sum(lg, lb) / (lb != -100).sum() for lg, lb in mbs) / 2
    assert naive.item() == pytest.approx(0.4904146265058631, abs=1e-12)


def test_step_gradients_equal_the_unpacked_mean():
    torch.manual_seed(0)
    head = torch.nn.Linear(3, 5, dtype=torch.float64)
    xs = [torch.randn(4, 3, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)]
    labels = [torch.tensor([1, -100, 4, 0]), torch.tensor([-100, -100, 2, 2, 3, 1, 0])]
    step = StepLoss.begin(labels, topology=ONE)
    for x, lb in zip(xs, labels, strict=True):
        step(head(x), lb).backward()
    packed = [p.grad.clone() for p in head.parameters()]
    head.zero_grad()
    reference = torch.nn.functional.cross_entropy(head(torch.cat(xs)), torch.cat(labels), ignore_index=-100)
    reference.backward()
    assert step.value().item() == pytest.approx(reference.item(), abs=1e-14)
    for got, want in zip(packed, (p.grad for p in head.parameters()), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


def test_grad_average_size_scales_the_backward_loss_only():
    (logits, labels), _ = two_micro_batches()
    denominator = count_loss_tokens([labels])
    one = packed_cross_entropy(logits, labels, denominator=denominator, grad_average_size=1)
    four = packed_cross_entropy(logits, labels, denominator=denominator, grad_average_size=4)
    assert four.item() == pytest.approx(4 * one.item(), abs=1e-15)
    step = StepLoss(denominator, grad_average_size=4)
    step(logits, labels)
    assert step.value().item() == pytest.approx(LOG2, abs=1e-15)  # the logged value is unscaled


def test_sequence_mean_weights_written_out():
    labels_T = torch.tensor([5, 6, -100, 7, -100, -100, 8, 9, -100, -100, -100, -100])
    meta = ThdMeta.from_lengths([4, 4, 4], [4, 4, 4])  # the third sequence has no loss token
    weights_T = loss_weights(labels_T, meta, reduction="sequence_mean")
    third = 1 / 3
    assert weights_T.tolist() == [third, third, 0.0, third, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
    assert weights_T.dtype == torch.float64 and weights_T.sum().item() == pytest.approx(2.0, abs=1e-15)
    assert loss_weights(labels_T, meta).tolist() == [1.0, 1.0, 0.0, 1.0, 0, 0, 1.0, 1.0, 0, 0, 0, 0]
    assert global_loss_denominator([weights_T[:6], weights_T[6:]]).item() == pytest.approx(2.0, abs=1e-15)


def test_sequence_mean_loss_written_out():
    # sequence 0: CE log 2 on one token; sequence 1: CE log(4/3) on three tokens
    logits_TV = torch.tensor([[0.0, 0.0]] + [[math.log(3), 0.0]] * 3, dtype=torch.float64)
    labels_T = torch.tensor([1, 0, 0, 0])
    weights_T = loss_weights(labels_T, ThdMeta.from_lengths([1, 3], [1, 3]), reduction="sequence_mean")
    step = StepLoss.begin([labels_T], micro_batch_weights=[weights_T], topology=ONE)
    step(logits_TV, labels_T, weights_T)
    assert step.value().item() == pytest.approx((LOG2 + LOG4_3) / 2, abs=1e-15)


def test_no_loss_token_gives_zero_not_nan():
    logits = torch.zeros(3, 4, dtype=torch.float64, requires_grad=True)
    labels = torch.full((3,), -100)
    loss = packed_cross_entropy(logits, labels, denominator=count_loss_tokens([labels]), grad_average_size=2)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


def test_half_precision_logits_are_upcast():
    logits = torch.zeros(2, 3, dtype=torch.bfloat16)
    total = cross_entropy_sum(logits, torch.tensor([0, 1]))
    assert total.dtype == torch.float32 and total.item() == pytest.approx(2 * math.log(3), abs=1e-6)


def test_bad_inputs_raise_with_the_values():
    logits, labels = torch.zeros(3, 4), torch.tensor([0, 1, 2])
    one = torch.tensor(3.0, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"grad_average_size must be an int >= 1 .* got 0"):
        packed_cross_entropy(logits, labels, denominator=one, grad_average_size=0)
    with pytest.raises(ValueError, match=r"labels \(2,\) do not match logits \(3, 4\)"):
        cross_entropy_sum(logits, labels[:2])
    with pytest.raises(ValueError, match=r"logits must be \(T, V\), got shape \(1, 3, 4\)"):
        cross_entropy_sum(logits[None], labels)
    with pytest.raises(ValueError, match=r"weights \(2,\) do not match labels \(3,\)"):
        cross_entropy_sum(logits, labels, torch.ones(2))
    with pytest.raises(TypeError, match=r"labels must be an integer tensor, got torch\.float32"):
        cross_entropy_sum(logits, labels.float())
    with pytest.raises(ValueError, match=r"unknown reduction 'mean'; use one of \['token_mean', 'sequence_mean'\]"):
        loss_weights(labels, ThdMeta.from_lengths([3], [3]), reduction="mean")
    with pytest.raises(
        ValueError, match=r"labels has 3 tokens but the THD layout holds 2 \(cu_seqlens_padded\[-1\]=2\)"
    ):
        loss_weights(labels, ThdMeta.from_lengths([2], [2]), reduction="sequence_mean")
    with pytest.raises(
        TypeError, match=r"meta must be the batch's ThdMeta \(thdpack.thd.carriage.thd_meta\(thd\)\), got Tensor"
    ):
        loss_weights(labels, torch.tensor([0, 3]), reduction="sequence_mean")
    shard_record = ThdMeta.from_lengths([4], [4], cp_size=2, cp_rank=1)
    with pytest.raises(ValueError, match=r"meta is CP rank 1's shard of cp_size=2; .* pass the GLOBAL batch's labels"):
        loss_weights(torch.zeros(2, dtype=torch.long), shard_record, reduction="sequence_mean")
    with pytest.raises(ValueError, match="micro_batch_weights is empty"):
        global_loss_denominator([])
    with pytest.raises(ValueError, match=r"a process group was given but torch\.distributed is not initialised"):
        count_loss_tokens([labels], group=object())


def test_a_described_topology_cannot_reduce_the_loss():
    described = CpTopology(dp_size=2, cp_size=2, rank=0, gpus_per_node=4)
    with pytest.raises(ValueError, match=r"topology dp 2 x cp 2 has no process groups \(a described mesh\); the loss"):
        StepLoss.begin([torch.tensor([1, 2])], topology=described)


def test_loss_weights_put_no_weight_on_padding_rows_whatever_their_labels():
    """Issue 26: live labels past a sequence's real length (a pack edited to seq_lens [3]) got weight."""
    labels_T = torch.tensor([5, 6, 7, 8, 9, 10, -100, -100])
    meta = ThdMeta.from_lengths([3], [8])
    assert loss_weights(labels_T, meta).tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    third = 1 / 3
    assert loss_weights(labels_T, meta, reduction="sequence_mean").tolist() == [third] * 3 + [0.0] * 5
