"""``math`` backend: exact tiled attention in plain PyTorch, with LSE and its gradient.

Any device, any float dtype (fp64 / fp32 on CPU included); memory O(sum of per-sequence squares).
The custom ``autograd.Function`` recomputes tiles in the backward from the saved output and LSE
(FlashAttention's scheme), so the activation memory is O(T), and the returned LSE is
differentiable (its gradient enters through ``delta = rowsum(dO * O) - dLSE``). Under context
parallelism the same tiles run inside thdpack's ring (``cp_comm_type="p2p"``) or after an
all-gather of K/V (``"all_gather"``).

Legend: ``T`` tokens, ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

from typing import Any

import torch

import thdpack.attention.math_kernel as math_kernel
from thdpack.attention.backends.base import AttentionBackend, AttentionCall, AttentionOutput, CallFacts
from thdpack.cp.partition import local_placement
from thdpack.thd.tokens import TokenPlacement


class TiledAttention(torch.autograd.Function):
    """``(out_TNH, lse_NT) = attention(q rows of side q -> k rows of side k)`` with exact gradients."""

    @staticmethod
    def forward(
        ctx: Any,
        q_TNH: torch.Tensor,
        k_TNH: torch.Tensor,
        v_TNH: torch.Tensor,
        q_side: TokenPlacement,
        k_side: TokenPlacement,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out_TNH, lse_NT = math_kernel.tile_forward(q_TNH, k_TNH, v_TNH, q_side, k_side, causal=causal, scale=scale)
        ctx.save_for_backward(q_TNH, k_TNH, v_TNH, out_TNH, lse_NT)
        ctx.sides, ctx.causal, ctx.scale = (q_side, k_side), causal, scale
        ctx.set_materialize_grads(False)
        return out_TNH.to(q_TNH.dtype), lse_NT

    @staticmethod
    def backward(ctx: Any, dout_TNH: torch.Tensor | None, dlse_NT: torch.Tensor | None) -> tuple[Any, ...]:
        q_TNH, k_TNH, v_TNH, out_TNH, lse_NT = ctx.saved_tensors
        dout_TNH, delta_NT = math_kernel.backward_inputs(dout_TNH, out_TNH, dlse_NT, q_TNH.dtype)
        dq, dk, dv = math_kernel.tile_backward(
            dout_TNH, q_TNH, k_TNH, v_TNH, lse_NT, delta_NT, *ctx.sides, causal=ctx.causal, scale=ctx.scale
        )
        return dq.to(q_TNH.dtype), dk.to(k_TNH.dtype), dv.to(v_TNH.dtype), None, None, None, None


def attend(
    q_TNH: torch.Tensor,
    k_TNH: torch.Tensor,
    v_TNH: torch.Tensor,
    side: TokenPlacement,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Self-attention of one device's packed tokens (``side`` describes them); ``(out, lse)``."""
    return TiledAttention.apply(q_TNH, k_TNH, v_TNH, side, side, causal, scale)


def kernel_problem(s: CallFacts) -> None:
    """None: exact math runs on any device, in any float dtype, with the LSE and its gradient."""
    return None


def _attend_call(q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor, call: AttentionCall) -> AttentionOutput:
    return attend(q_TNH, k_TNH, v_TNH, local_placement(call.meta, q_TNH.device), causal=call.causal, scale=call.scale)


BACKEND = AttentionBackend(
    name="math", cp={"p2p": "ring_math", "all_gather": "all_gather"}, kernel_problem=kernel_problem, attend=_attend_call
)
