"""Log-sum-exp arithmetic shared by every tiled attention path.

Attention over a key set split into disjoint parts is exact when the parts' partial results
are merged by their log-sum-exp (LSE): with ``lse = log(e^lse_a + e^lse_b)``,
``out = e^(lse_a - lse) * out_a + e^(lse_b - lse) * out_b``. Both weights are <= 1, so nothing
overflows. A row with no visible key has ``out = 0`` and ``lse = -inf``; merging two such rows
must give ``0`` and ``-inf`` again, never NaN.

Legend: ``T`` tokens (rows), ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

from typing import Any

import torch


def normalize_lse(lse_NT: torch.Tensor) -> torch.Tensor:
    """Map FlashAttention's ``+inf`` "no visible key" sentinel to ``-inf``, the math convention.

    FlashAttention-2 kernels write ``lse = +inf`` for a query row whose key set is empty; every
    thdpack path uses ``-inf`` (the true log of an empty sum), which the merge handles.
    """
    return lse_NT.masked_fill(torch.isposinf(lse_NT), float("-inf"))


def merge_partials(
    out_TNH: torch.Tensor, lse_NT: torch.Tensor, part_out_TNH: torch.Tensor, part_lse_NT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions of the same query rows over disjoint key sets.

    Args:
        out_TNH: (T, N, H) partial output so far (accumulation dtype, e.g. fp32 / fp64).
        lse_NT: (N, T) its natural-log LSE; ``-inf`` where no key was seen yet.
        part_out_TNH: (T, N, H) the new part's output (any float dtype; cast to ``out_TNH``'s).
        part_lse_NT: (N, T) the new part's LSE (``-inf`` for empty rows; map FlashAttention's
            ``+inf`` with :func:`normalize_lse` first).

    Returns:
        ``(out_TNH, lse_NT)`` over the union of the key sets, in ``out_TNH``'s dtype. Rows empty on
        both sides stay ``0`` / ``-inf`` (no NaN).

    >>> out = torch.tensor([[[1.0]], [[0.0]]])                  # 2 rows, 1 head, dim 1
    >>> lse = torch.tensor([[0.0, float("-inf")]])
    >>> part_out, part_lse = torch.tensor([[[3.0]], [[0.0]]]), torch.tensor([[0.0, float("-inf")]])
    >>> o, l = merge_partials(out, lse, part_out, part_lse)
    >>> o.flatten().tolist(), l.flatten().tolist()              # equal weights; empty row stays empty
    ([2.0, 0.0], [0.6931..., -inf])
    """
    part_lse_NT = part_lse_NT.to(lse_NT.dtype)
    new_lse_NT = torch.logaddexp(lse_NT, part_lse_NT)
    empty_NT = torch.isneginf(new_lse_NT)
    # exp(-inf - (-inf)) is NaN: measure both weights against 0 where the union is empty too
    safe_NT = new_lse_NT.masked_fill(empty_NT, 0.0)
    w_old_TN1 = torch.exp(lse_NT - safe_NT).T.unsqueeze(-1)
    w_new_TN1 = torch.exp(part_lse_NT - safe_NT).T.unsqueeze(-1)
    merged_TNH = out_TNH * w_old_TN1 + part_out_TNH.to(out_TNH.dtype) * w_new_TN1
    return merged_TNH, new_lse_NT


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64 (the exactness proofs); everything else accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _NoLseGradient(torch.autograd.Function):
    """Identity on an LSE whose producer drops its gradient: fail loudly instead of silently."""

    @staticmethod
    def forward(ctx: Any, lse_NT: torch.Tensor, producer: str) -> torch.Tensor:
        ctx.producer = producer
        return lse_NT.view_as(lse_NT)

    @staticmethod
    def backward(ctx: Any, dlse_NT: torch.Tensor) -> tuple[torch.Tensor, None]:
        if bool(dlse_NT.ne(0).any()):
            raise RuntimeError(
                f"a loss depends on the LSE returned by {ctx.producer}, whose kernel ignores the LSE's "
                "gradient; use backend='math' (any device) or a cp_group ring, which differentiate it"
            )
        return dlse_NT, None


def no_lse_gradient(lse_NT: torch.Tensor, producer: str) -> torch.Tensor:
    """``lse_NT`` unchanged, but a nonzero gradient reaching it raises ``RuntimeError``.

    flash-attn's ``flash_attn_varlen_func`` and torch's ``varlen_attn`` return an LSE whose
    gradient their backward ignores; a loss using it would train on a wrong gradient.
    """
    return _NoLseGradient.apply(lse_NT, producer)
