"""Packed cross-entropy normalised over the whole global batch: DP ranks, CP ranks, micro-steps.

A step's loss must equal the unpacked token mean over the global batch, and a mean of per-rank
means does not (it weighs each token by 1 / its rank's loss tokens). ``StepLoss`` counts the
step's loss tokens with one collective and divides every rank's summed loss by them; the recipe,
the gradient-average factor ``G`` and the per-sequence mean are in docs/guides/own-loop.md.

Legend: ``T`` tokens of this rank's micro-batch (a CP shard: the global pack's T / cp_size),
``V`` vocabulary, ``S`` sequences of a THD batch.

>>> import math
>>> logits_TV = torch.zeros(4, 3, dtype=torch.float64)       # uniform: CE = log 3 per token
>>> labels_T = torch.tensor([1, -100, 2, 0])
>>> denominator = count_loss_tokens([labels_T])              # 3 loss tokens (one process)
>>> loss = packed_cross_entropy(logits_TV, labels_T, denominator=denominator, grad_average_size=1)
>>> round(loss.item(), 6) == round(math.log(3), 6)
True
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, get_args

import torch
import torch.distributed as dist
import torch.nn.functional as F

from thdpack.cp.topology import CpTopology
from thdpack.layout.rules import IGNORE_INDEX
from thdpack.thd.meta import ThdMeta
from thdpack.thd.tokens import global_placement

LossReduction = Literal["token_mean", "sequence_mean"]
LOSS_REDUCTIONS: tuple[str, ...] = get_args(LossReduction)


def loss_weights(
    labels_T: torch.Tensor,
    meta: ThdMeta,
    *,
    reduction: LossReduction = "token_mean",
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Per-token loss weights of a GLOBAL (not yet CP-sharded) THD batch; shard them like tokens.

    Args:
        labels_T: (T,) integer labels, already next-token shifted; ``ignore_index`` = no loss.
        meta: the batch's record (``thdpack.thd.carriage.thd_meta(thd)``), whose sequences the
            ``"sequence_mean"`` weights follow; a global record (``cp_size`` 1) of ``T`` tokens.
        reduction: ``"token_mean"``: 1 for every loss token. ``"sequence_mean"``: ``1 / n_s`` for
            each loss token of sequence ``s`` with ``n_s`` loss tokens.

    Returns (T,) float64 on ``labels_T``'s device; 0 where the label is ``ignore_index`` and on
    padding rows (past a sequence's real length in ``meta``, whatever their label says).
    The sum is the number of loss tokens (token mean) or of sequences with loss tokens.

    >>> from thdpack.thd.meta import ThdMeta
    >>> labels = torch.tensor([5, 6, -100, 7, -100, -100, 8, 9])
    >>> meta = ThdMeta.from_lengths([4, 4], [4, 4])
    >>> loss_weights(labels, meta, reduction="sequence_mean").tolist()
    [0.3333333333333333, 0.3333333333333333, 0.0, 0.3333333333333333, 0.0, 0.0, 0.5, 0.5]
    """
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; use one of {list(LOSS_REDUCTIONS)}")
    _check_labels(labels_T)
    if not isinstance(meta, ThdMeta):
        raise TypeError(
            f"meta must be the batch's ThdMeta (thdpack.thd.carriage.thd_meta(thd)), got {type(meta).__name__}"
        )
    if meta.cp_size != 1:
        raise ValueError(
            f"meta is CP rank {meta.cp_rank}'s shard of cp_size={meta.cp_size}; sequence weights need the whole "
            "sequences: pass the GLOBAL batch's labels and record (before cp.shard), then shard the weights"
        )
    meta.check_token_count(len(labels_T), "labels")
    placement = global_placement(meta, labels_T.device)
    valid_T = ((labels_T != ignore_index) & placement.valid_T).to(torch.float64)
    if reduction == "token_mean":
        return valid_T
    seg_T = placement.seg_T
    loss_tokens_S = torch.zeros(meta.num_sequences, dtype=torch.float64, device=labels_T.device)
    loss_tokens_S.index_add_(0, seg_T, valid_T)
    return valid_T / loss_tokens_S.clamp_min(1.0)[seg_T]


def global_loss_denominator(
    micro_batch_weights: Iterable[torch.Tensor], *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The step's normaliser: this rank's weights over all its micro-batches, summed over ``group``.

    ``micro_batch_weights``: one (T,) tensor per micro-batch of this optimizer step (this rank's
    shards of ``loss_weights``). ``group``: the DP x CP group; None means the default group when
    torch.distributed is initialised, else this process alone. One all-reduce, before the
    micro-steps. Returns a float64 scalar tensor.
    """
    weights = list(micro_batch_weights)
    if not weights:
        raise ValueError("micro_batch_weights is empty: a step needs at least one micro-batch")
    total = torch.zeros((), dtype=torch.float64, device=weights[0].device)
    for w_T in weights:
        total += w_T.to(torch.float64).sum()
    return _all_reduce_sum(total, group)


def count_loss_tokens(
    micro_batch_labels: Iterable[torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """The global number of loss tokens of a step: ``global_loss_denominator`` for the token mean.

    ``micro_batch_labels``: this rank's (T,) labels of every micro-batch of the step.
    Returns a float64 scalar tensor (exact up to 2**53 tokens).
    """
    return global_loss_denominator(((labels_T != ignore_index) for labels_T in micro_batch_labels), group=group)


def cross_entropy_sum(
    logits_TV: torch.Tensor,
    labels_T: torch.Tensor,
    weights_T: torch.Tensor | None = None,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """``sum_t weights[t] * CE(logits[t], labels[t])`` over this rank's tokens (a scalar).

    ``logits_TV``: (T, V) floating; bf16 / fp16 are upcast to fp32 (as NeMo does) so the
    log-softmax and the sum are accurate. ``labels_T``: (T,) integer. ``weights_T``: (T,) or None
    (weight 1); tokens labelled ``ignore_index`` contribute 0 either way.
    """
    if logits_TV.dim() != 2:
        raise ValueError(f"logits must be (T, V), got shape {tuple(logits_TV.shape)}")
    _check_labels(labels_T)
    if labels_T.shape != logits_TV.shape[:1]:
        raise ValueError(f"labels {tuple(labels_T.shape)} do not match logits {tuple(logits_TV.shape)}")
    if weights_T is not None and weights_T.shape != labels_T.shape:
        raise ValueError(f"weights {tuple(weights_T.shape)} do not match labels {tuple(labels_T.shape)}")
    if logits_TV.dtype in (torch.float16, torch.bfloat16):
        logits_TV = logits_TV.float()
    ce_T = F.cross_entropy(logits_TV, labels_T.long(), ignore_index=ignore_index, reduction="none")
    if weights_T is None:
        return ce_T.sum()
    return (ce_T * weights_T.to(ce_T.dtype)).sum()


def packed_cross_entropy(
    logits_TV: torch.Tensor,
    labels_T: torch.Tensor,
    *,
    denominator: torch.Tensor,
    grad_average_size: int,
    weights_T: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """This micro-batch's loss to call ``backward()`` on: ``cross_entropy_sum / denominator * G``.

    Args:
        logits_TV, labels_T, weights_T: as in ``cross_entropy_sum`` (this rank's CP shard).
        denominator: the step's ``count_loss_tokens`` / ``global_loss_denominator``.
        grad_average_size: G, the number of ranks your gradient reduction AVERAGES over
            (docs/guides/own-loop.md, "The loss"): 1 for one process or a SUM reduction, ``dp_size``
            for DDP over DP with CP gradients summed by you, ``dp_size * cp_size`` for FSDP over the
            DP x CP mesh. Required, because the wrong value silently scales every gradient.
        ignore_index: the label of tokens without loss.

    Returns:
        A scalar tensor; summed over micro-steps and ranks, ``loss / G`` is the global mean loss.
    """
    if isinstance(grad_average_size, bool) or not isinstance(grad_average_size, int) or grad_average_size < 1:
        raise ValueError(
            f"grad_average_size must be an int >= 1 (the ranks your DDP/FSDP averages over), got {grad_average_size!r}"
        )
    total = cross_entropy_sum(logits_TV, labels_T, weights_T, ignore_index=ignore_index)
    safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator)).to(total.dtype)
    return total / safe * grad_average_size


class StepLoss:
    """One optimizer step's globally normalised loss (docs/guides/own-loop.md, "The loss").

    ``StepLoss.begin`` counts the step's denominator; call the object on every micro-batch and
    ``backward()`` what it returns; ``value()`` is the global loss so far.

    Args:
        denominator: the step's global loss tokens (or sum of loss weights).
        grad_average_size: G, the ranks the gradient reduction averages over.
        group: the DP x CP process group ``value()`` sums over (None: this process alone).
        ignore_index: the label of tokens without loss.

    >>> import math
    >>> from thdpack.cp.topology import CpTopology
    >>> mbs = [torch.tensor([1, 2, -100]), torch.tensor([0, 1, 1, 2])]   # one rank, 2 micro-batches
    >>> step = StepLoss.begin(mbs, topology=CpTopology.single())          # 6 loss tokens
    >>> for labels_T in mbs:
    ...     logits_TV = torch.zeros(len(labels_T), 3, dtype=torch.float64, requires_grad=True)
    ...     step(logits_TV, labels_T).backward()
    >>> round(step.value().item(), 6) == round(math.log(3), 6)
    True
    """

    def __init__(
        self,
        denominator: torch.Tensor,
        *,
        grad_average_size: int,
        group: dist.ProcessGroup | None = None,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        self.denominator = denominator
        self.grad_average_size = grad_average_size
        self.group = group
        self.ignore_index = ignore_index
        self._local_share = torch.zeros((), dtype=torch.float64, device=denominator.device)
        self.loss_tokens: torch.Tensor | None = None
        """The step's global number of loss tokens (set by ``begin``, in the denominator's collective)."""

    @classmethod
    def begin(
        cls,
        micro_batch_labels: Iterable[torch.Tensor],
        *,
        topology: CpTopology,
        micro_batch_weights: Iterable[torch.Tensor] | None = None,
        ignore_index: int = IGNORE_INDEX,
    ) -> StepLoss:
        """Count the step's global denominator (one collective over ``topology.dp_cp_group``) from
        every micro-batch's labels, or from ``micro_batch_weights`` (``loss_weights`` shards) for
        the per-sequence mean. The same collective counts the step's loss tokens (``loss_tokens``).
        ``G`` is ``topology.grad_average_size`` (a gradient average over every rank); for another
        reduction build the step with the constructor and your own ``grad_average_size``."""
        if topology.world_size > 1 and topology.dp_cp_group is None:
            raise ValueError(
                f"topology dp {topology.dp_size} x cp {topology.cp_size} has no process groups (a described mesh); "
                "the loss all-reduces over them: make it with CpTopology.create(...) on every process"
            )
        group, grad_average_size = topology.dp_cp_group, topology.grad_average_size
        labels = list(micro_batch_labels)
        if not labels:
            raise ValueError("micro_batch_labels is empty: a step needs at least one micro-batch")
        tokens = torch.zeros((), dtype=torch.float64, device=labels[0].device)
        for labels_T in labels:
            tokens += (labels_T != ignore_index).sum()
        if micro_batch_weights is None:
            weights = tokens
        else:
            weights = torch.zeros((), dtype=torch.float64, device=labels[0].device)
            for w_T in micro_batch_weights:
                weights += w_T.to(torch.float64).sum()
        both = _all_reduce_sum(torch.stack([weights, tokens]), group)
        step = cls(both[0], grad_average_size=grad_average_size, group=group, ignore_index=ignore_index)
        step.loss_tokens = both[1]
        return step

    def __call__(
        self, logits_TV: torch.Tensor, labels_T: torch.Tensor, weights_T: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The micro-batch's loss, ready for ``backward()`` (``packed_cross_entropy``)."""
        loss = packed_cross_entropy(
            logits_TV,
            labels_T,
            denominator=self.denominator,
            grad_average_size=self.grad_average_size,
            weights_T=weights_T,
            ignore_index=self.ignore_index,
        )
        self._local_share += loss.detach().to(torch.float64) / self.grad_average_size
        return loss

    def value(self) -> torch.Tensor:
        """The global loss of the step so far (float64 scalar); all-reduces over ``group``."""
        return _all_reduce_sum(self._local_share.clone(), self.group)


def _check_labels(labels_T: torch.Tensor) -> None:
    if labels_T.dim() != 1:
        raise ValueError(f"labels must be 1-D (T,), got shape {tuple(labels_T.shape)}")
    if labels_T.dtype.is_floating_point or labels_T.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels_T.dtype}")


def _all_reduce_sum(total: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    elif group is not None:
        raise ValueError("a process group was given but torch.distributed is not initialised")
    return total
