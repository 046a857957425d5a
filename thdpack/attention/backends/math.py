"""``math`` backend: exact tiled attention in plain PyTorch, with LSE and its gradient.

Any device, any float dtype (fp64 / fp32 on CPU included); memory O(sum of per-sequence squares).
The custom ``autograd.Function`` recomputes tiles in the backward from the saved output and LSE
(FlashAttention's scheme), so the activation memory is O(T), and the returned LSE is
differentiable (its gradient enters through ``delta = rowsum(dO * O) - dLSE``). Under context
parallelism the same tiles run inside thdpack's ring (``cp_comm_type="p2p"``), after an
all-gather of K/V (``"all_gather"``), or on the whole sequences an all-to-all delivers (``"a2a"``).

Legend: ``T`` tokens, ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import thdpack.attention.math_kernel as math_kernel
from thdpack.attention.backends.base import MATH_CP, AttentionBackend, AttentionCall, AttentionOutput, CallFacts
from thdpack.attention.math_kernel import Tile
from thdpack.attention.merge import Gradients, OutputGrads, Saved, differentiable_attention
from thdpack.cp.partition import local_placement
from thdpack.thd.tokens import TokenPlacement


@dataclass(frozen=True)
class MathTile:
    """:mod:`~thdpack.attention.math_kernel`'s tiles of one ``tile`` (an
    :class:`~thdpack.attention.merge.LseAttention`)."""

    tile: Tile

    def forward(self, q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return math_kernel.tile_forward(q_TNH, k_TNH, v_TNH, self.tile)

    def backward(self, saved: Saved, grads: OutputGrads) -> Gradients:
        q_TNH, k_TNH, v_TNH, _, lse_NT = saved
        return math_kernel.tile_backward(grads.dout_TNH, q_TNH, k_TNH, v_TNH, lse_NT, grads.delta_NT, self.tile)


def tiled_attention(
    q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor, tile: Tile
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_TNH, lse_NT)`` of ``tile.q``'s rows attending ``tile.k``'s rows, with exact gradients."""
    return differentiable_attention(q_TNH, k_TNH, v_TNH, MathTile(tile))


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
    return tiled_attention(q_TNH, k_TNH, v_TNH, Tile(side, side, causal, scale))


def kernel_problem(s: CallFacts) -> None:
    """None: exact math runs on any device, in any float dtype, with the LSE and its gradient."""
    return None


def _attend_call(q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor, call: AttentionCall) -> AttentionOutput:
    return attend(q_TNH, k_TNH, v_TNH, local_placement(call.meta, q_TNH.device), causal=call.causal, scale=call.scale)


BACKEND = AttentionBackend(
    name="math", cp={**MATH_CP, "a2a": "a2a"}, kernel_problem=kernel_problem, attend=_attend_call
)
