"""Log-sum-exp arithmetic shared by every tiled attention path, and their one autograd function.

Attention over a key set split into disjoint parts is exact when the partial results merge by
their log-sum-exp: ``lse = log(e^lse_a + e^lse_b)``, ``out = e^(lse_a - lse) * out_a + e^(lse_b -
lse) * out_b`` (both weights <= 1, so nothing overflows; two empty rows merge to ``0`` and
``-inf``, never NaN). Every tiled path (math tiles, the ring, the all-gather) recomputes its tiles
in the backward from the final ``out`` and ``lse``: each is an :class:`LseAttention`, and
:func:`differentiable_attention` is the one autograd function around them.

Legend: ``T`` tokens (rows), ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

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


class Saved(NamedTuple):
    """What a tiled backward recomputes from: the inputs and the FINAL (all keys merged) out / LSE."""

    q_TNH: torch.Tensor
    k_TNH: torch.Tensor
    v_TNH: torch.Tensor
    out_TNH: torch.Tensor
    """In the accumulation dtype."""
    lse_NT: torch.Tensor


class OutputGrads(NamedTuple):
    """The gradients that reach an attention's outputs, as a tiled backward uses them."""

    dout_TNH: torch.Tensor
    """Of the output (zeros when only the LSE has a gradient)."""
    delta_NT: torch.Tensor
    """(Nq, T) ``rowsum(dout * out) - dlse``: the LSE's gradient enters the backward only through it."""
    dlse_NT: torch.Tensor | None
    """Of the LSE itself, None when it has none."""


def output_grads(
    dout_TNH: torch.Tensor | None, out_TNH: torch.Tensor, dlse_NT: torch.Tensor | None, dtype: torch.dtype
) -> OutputGrads:
    """The :class:`OutputGrads` of the incoming gradients (None: no gradient), with ``out_TNH`` the
    final output in the accumulation dtype; a missing ``dout`` becomes zeros in ``dtype`` (the
    inputs'), ``delta`` is in ``out``'s dtype."""
    if dout_TNH is None:
        dout_TNH = torch.zeros(out_TNH.shape, dtype=dtype, device=out_TNH.device)
    delta_NT = (dout_TNH.to(out_TNH.dtype) * out_TNH).sum(-1).T
    if dlse_NT is not None:
        delta_NT = delta_NT - dlse_NT.to(out_TNH.dtype)
    return OutputGrads(dout_TNH, delta_NT, dlse_NT)


Gradients = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(dq, dk, dv)``."""


class LseAttention(Protocol):
    """One exact attention computation: its forward, and its backward from the final out / LSE."""

    def forward(self, q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(out_TNH, lse_NT)``, both in the accumulation dtype."""
        ...

    def backward(self, saved: Saved, grads: OutputGrads) -> Gradients:
        """``(dq, dk, dv)`` of q, k, v (any float dtype; cast to the inputs' by the caller)."""
        ...


class _Differentiable(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor, attention: LseAttention
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out_TNH, lse_NT = attention.forward(q_TNH, k_TNH, v_TNH)
        ctx.save_for_backward(q_TNH, k_TNH, v_TNH, out_TNH, lse_NT)
        ctx.attention = attention
        ctx.set_materialize_grads(False)
        return out_TNH.to(q_TNH.dtype), lse_NT

    @staticmethod
    def backward(ctx: Any, dout_TNH: torch.Tensor | None, dlse_NT: torch.Tensor | None) -> tuple[Any, ...]:
        saved = Saved(*ctx.saved_tensors)
        grads = output_grads(dout_TNH, saved.out_TNH, dlse_NT, saved.q_TNH.dtype)
        dq, dk, dv = ctx.attention.backward(saved, grads)
        return dq.to(saved.q_TNH.dtype), dk.to(saved.k_TNH.dtype), dv.to(saved.v_TNH.dtype), None


def differentiable_attention(
    q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor, attention: LseAttention
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_TNH, lse_NT)`` of ``attention``: out in q's dtype, lse in the accumulation dtype, both
    differentiable; the backward keeps only q, k, v, out and lse (O(T) activation memory)."""
    return _Differentiable.apply(q_TNH, k_TNH, v_TNH, attention)
