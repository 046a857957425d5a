"""Model-level exactness: one packed, CP-sharded, DP-spread, gradient-accumulated training step of
the reference decoder against the same step on every sequence alone.

The packed step is the pipeline as a trainer runs it (plan, packs dealt to micro-steps and DP
ranks, ``thd_collate``, ``cp.shard``, the decoder with the topology, ``StepLoss``, gradients
averaged over DP x CP); the unpacked step runs each sequence alone and takes the global mean.
Both start from identical weights; ``differences`` gives the largest difference of the loss, the
real tokens' logits and every gradient. ``Fault`` plants a known layout bug, so one can watch the
comparison catch it.

Legend: ``T`` tokens of a micro-batch on this rank, ``V`` vocabulary, ``S`` sequences.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from thdpack._settings import check_int
from thdpack.cp.partition import local_placement, shard
from thdpack.cp.topology import CpTopology
from thdpack.layout.rules import cp_multiple
from thdpack.loss import LOSS_REDUCTIONS, LossReduction, StepLoss, cross_entropy_sum, loss_weights
from thdpack.models.transformer import Transformer
from thdpack.packing.dealing import round_robin
from thdpack.packing.packer import build_pack, pack_from_segments
from thdpack.plan.api import plan_packs
from thdpack.plan.config import CP_PLACEMENTS, LIBRARY_CP_PLACEMENT, CpPlacementMode
from thdpack.thd.batch import thd_collate
from thdpack.thd.carriage import thd_meta
from thdpack.thd.format import THDBatch
from thdpack.train.forward_backward import StepHooks, forward_backward, prepare_micro_batches

Fault = Literal["none", "cross_sequence_attention", "local_positions", "foreign_shard", "mean_of_means"]
FAULTS: tuple[Fault, ...] = get_args(Fault)
"""Layout bugs ``packed_step`` can plant: attention over the whole micro-batch as if it were one
sequence; RoPE from each token's local index on its CP rank instead of its global position
(needs CP); every CP rank computing on the next rank's shard (needs CP); the loss as a mean of
per-rank, per-micro-step means. Positions that fail to restart per sequence are NOT in the list:
RoPE depends only on the distance between two positions of one sequence, so a per-sequence
offset changes nothing here (Hugging Face's position-id boundary inference is another matter:
``thdpack.models.hf.attention``)."""

BASE_LENGTHS = (13, 1, 4, 9, 2, 17, 8, 6, 3, 11, 5, 7)
"""Sequence lengths of one copy of the test batch: a length-1 sequence (no loss token), 2, 4 and 8
(exactly 2*cp_size tokens for cp 1, 2, 4), lengths that CP padding rounds up, 86 tokens in all."""

_TRACE_KEYS = ("sequence_index", "sequence_position")
"""Per-token keys that say which sample and position a token is: how logits are matched up."""


@dataclass(frozen=True, kw_only=True)
class StepSpread:
    """How the global batch is spread for one optimizer step."""

    dp_size: int = 1
    """Data-parallel ranks; each gets its own packs."""
    cp_size: int = 1
    """Context-parallel ranks per DP rank; they share every micro-batch, one shard each."""
    micro_steps: int = 2
    """Gradient-accumulation micro-steps per optimizer step."""
    reduction: LossReduction = "token_mean"
    """``"token_mean"`` or ``"sequence_mean"`` (``thdpack.loss``)."""
    fault: Fault = "none"
    """A layout bug to plant (``FAULTS``), or ``"none"``."""
    cp_placement: CpPlacementMode = LIBRARY_CP_PLACEMENT
    """How the packs place their sequences on the CP ranks: ``"te"`` (every sequence split over all)
    or ``"adaptive"`` (whole on one rank or split over a group: ``thdpack.plan.adaptive``)."""

    def __post_init__(self) -> None:
        for name in ("dp_size", "cp_size", "micro_steps"):
            check_int(name, getattr(self, name), 1)
        if self.reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"unknown reduction {self.reduction!r}; valid: {', '.join(map(repr, LOSS_REDUCTIONS))}")
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; valid: {', '.join(map(repr, FAULTS))}")
        if self.cp_placement not in CP_PLACEMENTS:
            raise ValueError(f"unknown cp_placement {self.cp_placement!r}; valid: {', '.join(CP_PLACEMENTS)}")
        if self.fault in ("local_positions", "foreign_shard") and self.cp_size == 1:
            raise ValueError(f"fault {self.fault!r} only exists under context parallelism; use cp_size >= 2")

    @property
    def world_size(self) -> int:
        return self.dp_size * self.cp_size


def sample_lengths(spread: StepSpread) -> list[int]:
    """Lengths of the test batch for ``spread``: copies of ``BASE_LENGTHS`` (enough for every
    (micro-step, DP rank) to get a pack), plus a sequence of exactly 2*cp_size tokens."""
    copies = math.ceil(spread.dp_size * spread.micro_steps / 4)
    lengths = list(BASE_LENGTHS) * copies
    if 2 * spread.cp_size not in lengths:
        lengths.append(2 * spread.cp_size)
    return lengths


def make_samples(lengths: Sequence[int], vocab_size: int, seed: int) -> list[dict[str, np.ndarray]]:
    """Random token sequences; every third one masks a prompt (its first third) out of the loss."""
    rng = np.random.default_rng(seed)
    samples = []
    for i, n in enumerate(lengths):
        sample = {"input_ids": rng.integers(1, vocab_size, n)}
        if i % 3 == 2:
            sample["loss_mask"] = (np.arange(n) >= n // 3).astype(np.int64)
        samples.append(sample)
    return samples


def pack_size_for(lengths: Sequence[int], cp_size: int, cp_placement: CpPlacementMode = LIBRARY_CP_PLACEMENT) -> int:
    """The smallest multiple of ``2*cp_size`` that is >= 24 and >= the longest sequence; under
    ``cp_placement="adaptive"`` also >= ``10 * cp_size`` (a rank's budget of 10 tokens), so that
    the test lengths mix sequences whole on one rank, split over a pair of ranks (cp >= 4) and
    split over all of them."""
    multiple = cp_multiple(cp_size)
    least = max(24, *lengths, 10 * cp_size if cp_placement == "adaptive" else 0)
    return -(-least // multiple) * multiple


def global_micro_batches(
    samples: Sequence[Mapping[str, Any]], spread: StepSpread, pack_size: int
) -> list[list[THDBatch]]:
    """``[dp_rank][micro_step]``: the global (unsharded) THD micro-batches of one optimizer step.

    The samples are planned into packs once (BFD, CP padding for ``spread.cp_size``, placed by
    ``spread.cp_placement``) and dealt
    round robin (``thdpack.packing.dealing.round_robin``) to ``bins = dp_size * micro_steps`` hands;
    hand ``h`` is micro-step ``h // dp_size`` of DP rank ``h % dp_size``, so micro-batches hold
    different numbers of packs and tokens. Extra per-token keys, re-indexed by ``cp.shard`` like
    the tokens: ``sequence_index`` (the sample a token belongs to), ``sequence_position`` (its
    true position in it) and ``loss_weights``.
    """
    lengths = [len(s["input_ids"]) for s in samples]
    plan = plan_packs(lengths, pack_size, cp_size=spread.cp_size, cp_placement=spread.cp_placement)
    bins = spread.dp_size * spread.micro_steps
    if len(plan) < bins:
        raise ValueError(f"{len(plan)} packs for {bins} (micro-step, DP rank) slots; use more samples or fewer ranks")
    batches: list[list[list[dict[str, Any]]]] = [[[] for _ in range(spread.micro_steps)] for _ in range(spread.dp_size)]
    for hand, pack_indices in enumerate(round_robin(np.arange(len(plan)), bins)):
        for i in pack_indices.tolist():
            pack: dict[str, Any] = dict(build_pack(samples, plan, i))
            slots = pack["seq_lens_padded"].numpy()
            sample_S = np.full(len(slots), -1)  # a CP placement's padding entries hold no sample
            sample_S[: len(plan[i])] = plan[i]
            pack["sequence_index"] = torch.from_numpy(np.repeat(sample_S, slots))
            pack["sequence_position"] = pack["position_ids"].clone()
            batches[hand % spread.dp_size][hand // spread.dp_size].append(pack)
    out = []
    for per_rank in batches:
        thds = []
        for packs in per_rank:
            thd = thd_collate(packs)
            thd["loss_weights"] = loss_weights(thd["labels"], thd_meta(thd), reduction=spread.reduction)
            thds.append(thd)
        out.append(thds)
    return out


@dataclass
class PackedResult:
    """One rank's view of the packed step."""

    loss: float
    """The global loss of the step (the same on every rank)."""
    grads: dict[str, torch.Tensor]
    """Every parameter's gradient after the reduction (the same on every rank)."""
    tokens: list[dict[str, torch.Tensor]]
    """Per micro-step: this rank's ``logits`` (T, V) and each token's ``sequence_index``,
    ``sequence_position`` and ``real`` flag."""


def packed_step(
    model: Transformer,
    micro_batches: Sequence[Mapping[str, Any]],
    spread: StepSpread,
    topology: CpTopology,
    *,
    autocast_dtype: torch.dtype | None = None,
) -> PackedResult:
    """One optimizer step's forward and backward on this rank's CP shards of its micro-batches,
    run by the trainer's own step functions (``thdpack.train.forward_backward``) with ``spread.fault``
    planted through their hooks.

    ``micro_batches``: this DP rank's global THD micro-batches (``global_micro_batches()[dp_rank]``),
    on the model's device. ``topology``: this process's place in the spread's dp x cp mesh
    (``CpTopology.create``; ``CpTopology.single()`` for one process without torch.distributed).
    ``autocast_dtype``: run the forward under ``torch.autocast`` (bf16). Gradients are reduced as
    the trainer's DDP reduces them: an average over the DP x CP group.
    """
    if (topology.dp_size, topology.cp_size) != (spread.dp_size, spread.cp_size):
        raise ValueError(
            f"the topology is dp {topology.dp_size} x cp {topology.cp_size} but the spread dp {spread.dp_size} x cp "
            f"{spread.cp_size}; run the spread on dp_size * cp_size = {spread.world_size} processes"
        )
    device = next(model.parameters()).device
    tokens: list[dict[str, torch.Tensor]] = []
    naive_share = torch.zeros((), dtype=torch.float64, device=device)

    def record(k: int, logits_TV: torch.Tensor, mb: THDBatch) -> None:
        tokens.append(
            {"logits": logits_TV.detach(), "real": ~mb["padding_mask"], **{key: mb[key] for key in _TRACE_KEYS}}
        )

    def mean_of_means(step_loss: StepLoss, logits_TV: torch.Tensor, mb: THDBatch) -> torch.Tensor:
        # the pitfall: normalise by this rank's own micro-batch, then average ranks and steps
        count = mb["loss_weights"].sum().clamp_min(1.0)
        weights_T = mb["loss_weights"] if spread.reduction == "sequence_mean" else None
        loss = cross_entropy_sum(logits_TV, mb["labels"], weights_T) / count / spread.micro_steps
        naive_share.add_(loss.detach().double() / spread.world_size)
        return loss  # and DDP averages the ranks' gradients, as a naive trainer would

    hooks = StepHooks(
        shard=lambda thd, cp_size, cp_rank: _rank_shard(thd, spread, cp_rank),
        loss=mean_of_means if spread.fault == "mean_of_means" else None,
        logits=record,
    )
    micro = prepare_micro_batches(
        micro_batches, topology=topology, device=device, reduction=spread.reduction, hooks=hooks
    )
    model.zero_grad(set_to_none=True)
    distributed = topology.world_size > 1
    replica = DistributedDataParallel(model, process_group=topology.dp_cp_group) if distributed else model
    with _autocast(device, autocast_dtype):
        step_loss = forward_backward(replica, micro, topology=topology, hooks=hooks)
    if spread.fault == "mean_of_means":
        if distributed:
            dist.all_reduce(naive_share, group=topology.dp_cp_group)
        global_loss = float(naive_share)
    else:
        global_loss = float(step_loss.value())
    return PackedResult(global_loss, _grads(model), tokens)


@dataclass
class UnpackedResult:
    """The unpacked reference step."""

    loss: float
    grads: dict[str, torch.Tensor]
    logits: list[torch.Tensor]
    """Per sample: (n, V) logits of the sample run alone."""
    weighted_token_losses: list[torch.Tensor]
    """Per sample: (n,) float64 cross-entropy of each token times its weight in the loss (0 for
    tokens without a label); the loss is their total."""


def unpacked_step(
    model: Transformer,
    samples: Sequence[Mapping[str, Any]],
    reduction: LossReduction,
    *,
    autocast_dtype: torch.dtype | None = None,
) -> UnpackedResult:
    """Every sample alone (one sequence, no padding, no CP), the loss averaged over all of them."""
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    token_losses, counts, logits = [], [], []
    for sample in samples:
        thd = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in _alone(sample).items()}
        with _autocast(device, autocast_dtype):
            logits_TV = model(thd)
        token_losses.append(
            F.cross_entropy(logits_TV.float() if autocast_dtype else logits_TV, thd["labels"], reduction="none")
        )
        counts.append(int((thd["labels"] != -100).sum()))
        logits.append(logits_TV.detach())
    if reduction == "token_mean":
        weights = [1.0 / sum(counts)] * len(samples)
    else:
        with_tokens = sum(n > 0 for n in counts)
        weights = [1.0 / (n * with_tokens) if n else 0.0 for n in counts]
    weighted = [ce_T * w for ce_T, w in zip(token_losses, weights, strict=True)]
    loss = torch.cat(weighted).sum()
    loss.backward()
    weighted_token_losses = [x.detach().double() for x in weighted]
    return UnpackedResult(float(loss.detach()), _grads(model), logits, weighted_token_losses)


def differences(packed: PackedResult, reference: UnpackedResult) -> dict[str, float]:
    """Max abs differences: ``"loss"``, ``"logits"`` (real tokens of this rank) and one
    ``"grad <parameter name>"`` per parameter, in ``named_parameters`` order."""
    diffs = {"loss": abs(packed.loss - reference.loss), "logits": 0.0}
    flat = torch.cat(reference.logits)
    starts = torch.tensor([0] + [len(x) for x in reference.logits], device=flat.device).cumsum(0)[:-1]
    for t in packed.tokens:
        real = t["real"]
        rows = starts[t["sequence_index"][real]] + t["sequence_position"][real]
        got, want = t["logits"][real].to(flat.dtype), flat[rows]
        if len(rows):
            diffs["logits"] = max(diffs["logits"], float((got - want).abs().max()))
    for name, grad in packed.grads.items():
        diffs[f"grad {name}"] = float((grad - reference.grads[name].to(grad.dtype)).abs().max())
    return diffs


def magnitudes(reference: UnpackedResult) -> dict[str, float]:
    """Max abs value of each quantity of ``differences`` in the reference (to read them against)."""
    sizes = {"loss": abs(reference.loss), "logits": max(float(x.abs().max()) for x in reference.logits)}
    sizes.update({f"grad {name}": float(grad.abs().max()) for name, grad in reference.grads.items()})
    return sizes


def baseline_errors(other: UnpackedResult, reference: UnpackedResult) -> dict[str, float]:
    """The error scale of another unpacked step (plain bf16) against the reference, with
    ``differences``' keys: max abs differences of logits and gradients; for ``"loss"`` the
    weighted sum of the per-token loss differences, which bounds the scalar loss difference but,
    unlike it, does not cancel by luck (a single scalar is no measure of a dtype's error)."""
    diffs = {"loss": 0.0, "logits": 0.0}
    for a, b, la, lb in zip(
        other.logits, reference.logits, other.weighted_token_losses, reference.weighted_token_losses, strict=True
    ):
        diffs["loss"] += float((la - lb).abs().sum())
        diffs["logits"] = max(diffs["logits"], float((a.to(b.dtype) - b).abs().max()))
    for name, grad in other.grads.items():
        diffs[f"grad {name}"] = float((grad.to(reference.grads[name].dtype) - reference.grads[name]).abs().max())
    return diffs


def _rank_shard(thd: Mapping[str, Any], spread: StepSpread, cp_rank: int) -> THDBatch:
    """``cp.shard`` of this rank, with ``spread.fault`` planted."""
    if spread.fault == "cross_sequence_attention":
        total = int(thd["cu_seqlens_padded"][-1])
        whole = torch.tensor([0, total], dtype=torch.int32, device=thd["cu_seqlens_padded"].device)
        thd = {**thd, "cu_seqlens": whole, "cu_seqlens_padded": whole, "max_seqlen": total}
    if spread.fault == "foreign_shard":
        return {**shard(thd, spread.cp_size, (cp_rank + 1) % spread.cp_size), "cp_rank": cp_rank}
    local = shard(thd, spread.cp_size, cp_rank)
    if spread.fault == "local_positions":  # each token's index among its sequence's rows on this rank
        rows_S = torch.tensor(local_placement(local["thd_meta"], "cpu").counts, dtype=torch.int64)
        starts = torch.repeat_interleave(torch.cumsum(rows_S, 0) - rows_S, rows_S)
        local["position_ids"] = (torch.arange(len(starts)) - starts).to(local["position_ids"].device)
    return local


def _alone(sample: Mapping[str, Any]) -> THDBatch:
    """A THD batch of one sample: one sequence, no padding."""
    pack = pack_from_segments([sample], ([0], [0], [len(sample["input_ids"])]), len(sample["input_ids"]))
    return thd_collate([pack])


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for name, p in model.named_parameters()
    }


@contextlib.contextmanager
def _autocast(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
    else:
        with torch.autocast(device.type, dtype=dtype):
            yield
