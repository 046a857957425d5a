"""Exact ring attention (P2P) over Transformer Engine's load-balanced THD layout, without TE.

Rank r of n holds chunks r (front) and 2n-1-r (back) of every sequence. K/V blocks travel around
the ring; at step s rank r holds the block of ``src = (r - s) mod n`` and computes one tile (TE's
schedule)::

    causal, s == 0       all q  x all kv    causal (local order is monotone in position)
    causal, 1 <= s <= r  all q  x front kv  full   (chunk src precedes both query chunks;
                                                    chunk 2n-1-src follows both)
    causal, s > r        back q x all kv    full   (query chunk r precedes both kv chunks;
                                                    query chunk 2n-1-r follows both)
    non-causal           all q  x all kv    full   (padded keys masked)

so every step after the first is half a tile and every rank does the same work. Partial results
merge by their log-sum-exp in fp32 (fp64 for fp64 inputs). The backward recomputes each tile with
the global out / LSE; the dK/dV accumulator travels with its K/V block back to its owner. Tile
kernels: ``"math"`` (any device and dtype) and ``"flash"`` (CUDA fp16 / bf16, PyTorch's
FlashAttention-2).

Legend: ``T`` local tokens, ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

import thdpack.attention.flash_kernel as flash_kernel
import thdpack.attention.math_kernel as math_kernel
from thdpack.attention.math_kernel import Tile
from thdpack.attention.merge import (
    Gradients,
    OutputGrads,
    Saved,
    accumulation_dtype,
    differentiable_attention,
    merge_partials,
)
from thdpack.cp.comm import Ring, RingComm
from thdpack.cp.partition import local_placement
from thdpack.thd.meta import ThdMeta
from thdpack.thd.tokens import TokenPlacement

Section = Literal["all", "front", "back"]
TileKernel = Literal["math", "flash"]
TILE_KERNELS: tuple[TileKernel, ...] = ("math", "flash")


def tile_sections(step: int, rank: int, causal: bool) -> tuple[Section, Section, bool]:
    """``(query rows, kv rows, causal mask)`` of the tile rank ``rank`` computes at ``step``.

    >>> [tile_sections(s, 2, True) for s in range(4)]   # rank 2 of 4
    [('all', 'all', True), ('all', 'front', False), ('all', 'front', False), ('back', 'all', False)]
    """
    if not causal:
        return "all", "all", False
    if step == 0:
        return "all", "all", True
    if step <= rank:
        return "all", "front", False
    return "back", "all", False


def _rows(side: TokenPlacement, section: Section) -> tuple[torch.Tensor | None, TokenPlacement]:
    """(row indices into the full local block, or None for all rows; the section's TokenPlacement)."""
    if section == "all":
        return None, side
    back = section == "back"
    return side.half_index(back), side.half(back)


def _take(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x.index_select(0, rows)


def _tile_plan(
    meta: ThdMeta, ring: Ring, step: int, causal: bool, scale: float, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None, Tile]:
    """``(query rows, kv rows, tile)`` of the tile this rank computes at ``step`` (rows: indices
    into the local and the held K/V block, None for all rows)."""
    q_section, kv_section, tile_causal = tile_sections(step, ring.rank, causal)
    q_rows, q_side = _rows(local_placement(meta, device, ring.rank), q_section)
    kv_rows, kv_side = _rows(local_placement(meta, device, (ring.rank - step) % ring.size), kv_section)
    return q_rows, kv_rows, Tile(q_side, kv_side, tile_causal, scale)


def ring_forward(
    ring: Ring,
    q_TNH: torch.Tensor,
    k_TNH: torch.Tensor,
    v_TNH: torch.Tensor,
    meta: ThdMeta,
    *,
    causal: bool,
    scale: float,
    kernel: TileKernel,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(out_TNH, lse_NT)`` in the accumulation dtype; every rank calls it together."""
    acc = accumulation_dtype(q_TNH.dtype)
    tq, nq = q_TNH.shape[:2]
    out_TNH = q_TNH.new_zeros((tq, nq, v_TNH.shape[-1]), dtype=acc)
    lse_NT = q_TNH.new_full((nq, tq), float("-inf"), dtype=acc)
    tile_forward = math_kernel.tile_forward if kernel == "math" else flash_kernel.tile_forward
    kv = [k_TNH, v_TNH]
    for step in range(ring.size):
        incoming = ring.send_recv(kv) if step + 1 < ring.size else None
        q_rows, kv_rows, tile = _tile_plan(meta, ring, step, causal, scale, q_TNH.device)
        part_out, part_lse = tile_forward(_take(q_TNH, q_rows), _take(kv[0], kv_rows), _take(kv[1], kv_rows), tile)
        if q_rows is None:
            out_TNH, lse_NT = merge_partials(out_TNH, lse_NT, part_out, part_lse)
        else:
            merged_out, merged_lse = merge_partials(out_TNH[q_rows], lse_NT[:, q_rows], part_out, part_lse)
            out_TNH[q_rows], lse_NT[:, q_rows] = merged_out, merged_lse
        if incoming is not None:
            kv = incoming.wait()
    return out_TNH, lse_NT


def ring_backward(
    ring: Ring,
    saved: Saved,
    grads: OutputGrads,
    meta: ThdMeta,
    *,
    causal: bool,
    scale: float,
    kernel: TileKernel,
) -> Gradients:
    """This rank's ``(dq, dk, dv)`` in the accumulation dtype, from the GLOBAL out / lse / delta.

    ``grads.delta_NT`` is used by math tiles; the flash kernel derives it from ``out_TNH`` itself
    and so cannot take a gradient of the LSE: one arriving (``grads.dlse_NT``) switches the pass
    to math tiles.
    """
    q_TNH, k_TNH, v_TNH, out_TNH, lse_NT = saved
    dout_TNH, delta_NT, dlse_NT = grads
    kernel = "math" if dlse_NT is not None else kernel
    acc = accumulation_dtype(q_TNH.dtype)
    dq_TNH = torch.zeros(q_TNH.shape, dtype=acc, device=q_TNH.device)
    dk_TNH = torch.zeros(k_TNH.shape, dtype=acc, device=k_TNH.device)
    dv_TNH = torch.zeros(v_TNH.shape, dtype=acc, device=v_TNH.device)
    out_for_kernel = out_TNH.to(q_TNH.dtype) if kernel == "flash" else out_TNH
    kv = [k_TNH, v_TNH]
    grads_in_flight = None
    for step in range(ring.size):
        incoming = ring.send_recv(kv) if step + 1 < ring.size else None
        q_rows, kv_rows, tile = _tile_plan(meta, ring, step, causal, scale, q_TNH.device)
        q_in, dout_in = _take(q_TNH, q_rows), _take(dout_TNH, q_rows)
        k_in, v_in = _take(kv[0], kv_rows), _take(kv[1], kv_rows)
        lse_in = lse_NT if q_rows is None else lse_NT[:, q_rows]
        if kernel == "flash":
            out_in = _take(out_for_kernel, q_rows)
            dq, dk, dv = flash_kernel.tile_backward(dout_in, q_in, k_in, v_in, out_in, lse_in, tile)
        else:
            delta_in = delta_NT if q_rows is None else delta_NT[:, q_rows]
            dq, dk, dv = math_kernel.tile_backward(dout_in, q_in, k_in, v_in, lse_in, delta_in, tile)
        if grads_in_flight is not None:
            dk_TNH, dv_TNH = grads_in_flight.wait()
        _accumulate(dq_TNH, q_rows, dq)
        _accumulate(dk_TNH, kv_rows, dk)
        _accumulate(dv_TNH, kv_rows, dv)
        if ring.size > 1:
            # the dK/dV accumulator follows its K/V block: at step s rank r holds owner r - s's
            grads_in_flight = ring.send_recv([dk_TNH, dv_TNH])
        if incoming is not None:
            kv = incoming.wait()
    if grads_in_flight is not None:
        dk_TNH, dv_TNH = grads_in_flight.wait()  # after n hops: our own block's gradient
    return dq_TNH, dk_TNH, dv_TNH


def _accumulate(total: torch.Tensor, rows: torch.Tensor | None, part: torch.Tensor) -> None:
    if rows is None:
        total += part.to(total.dtype)
    else:
        total.index_add_(0, rows, part.to(total.dtype))


@dataclass(frozen=True)
class RingPass:
    """This rank's share of ring attention (an :class:`~thdpack.attention.merge.LseAttention`):
    :func:`ring_forward`, and :func:`ring_backward` from the global out / LSE."""

    ring: Ring
    meta: ThdMeta
    causal: bool
    scale: float
    kernel: TileKernel

    def forward(self, q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return ring_forward(
            self.ring, q_TNH, k_TNH, v_TNH, self.meta, causal=self.causal, scale=self.scale, kernel=self.kernel
        )

    def backward(self, saved: Saved, grads: OutputGrads) -> Gradients:
        return ring_backward(
            self.ring, saved, grads, self.meta, causal=self.causal, scale=self.scale, kernel=self.kernel
        )


def ring_attention(
    q_TNH: torch.Tensor,
    k_TNH: torch.Tensor,
    v_TNH: torch.Tensor,
    meta: ThdMeta,
    *,
    cp_group: dist.ProcessGroup | None,
    causal: bool = True,
    scale: float,
    kernel: TileKernel = "math",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention of this rank's shard; call on every rank of ``cp_group`` together.

    Args:
        q_TNH: (T, Nq, H) this rank's queries in ``thdpack.cp.shard`` order.
        k_TNH / v_TNH: (T, Nkv, H) / (T, Nkv, Hv), ``Nq % Nkv == 0``.
        meta: the shard's record (:func:`thdpack.thd.carriage.thd_meta`; ``cp_size`` = ``cp_group``'s
            size, ``cp_rank`` = this rank in it, as ``ThdMeta.check_cp_group`` checks).
        cp_group: the context-parallel group (None: the default group).
        causal, scale: attention mask type and softmax scale.
        kernel: ``"math"`` or ``"flash"`` tiles.

    Returns:
        ``out_TNH`` (T, Nq, Hv) in q's dtype and ``lse_NT`` (Nq, T) (fp64 for fp64 inputs, else
        fp32); both differentiable.
    """
    ring = RingPass(RingComm(cp_group), meta, causal, scale, kernel)
    return differentiable_attention(q_TNH, k_TNH, v_TNH, ring)
