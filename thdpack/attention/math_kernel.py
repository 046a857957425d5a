"""Exact attention tiles in plain PyTorch: any device, any float dtype, bounded memory.

A tile is "the rows of side Q attend to the rows of side K": row i sees key j iff both are in one
sequence, j is real and, when causal, ``pos[i] >= pos[j]``. The mask comes from these per-token
facts, never from the tile's shape, so one kernel serves the single-device backend, every ring
step and the all-gather. Sequences are cut into blocks of at most ``_SCORE_BUDGET`` scores, so the
cost is O(sum of per-sequence squares), never O(T^2). The backward takes the global softmax
statistics of its rows, so per-tile gradients sum to the exact gradient (FlashAttention's
recomputation identity).

Legend: ``T`` rows (``Tq`` query, ``Tk`` key), ``N`` heads (``Nq`` query, ``Nkv`` key/value,
``G = Nq / Nkv`` query heads per KV head), ``H`` head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from thdpack.attention.masks import visible
from thdpack.attention.merge import accumulation_dtype
from thdpack.thd.tokens import TokenPlacement

# score-matrix elements (Nq * rows * keys) per block: 4M -> 32 MiB per fp64 temporary
_SCORE_BUDGET = 1 << 22
# short sequences share a block up to this size (fewer kernel launches); beyond it the work
# wasted on cross-sequence pairs outweighs the saved overhead
_GROUP_BUDGET = 1 << 16


@dataclass(frozen=True)
class Tile:
    """One tile's facts besides its tensors: rows of side ``q`` attend rows of side ``k`` (same
    number of sequences, same device)."""

    q: TokenPlacement
    k: TokenPlacement
    causal: bool
    """Apply ``pos_q >= pos_k``."""
    scale: float
    """The softmax scale."""


def plan_blocks(
    q: TokenPlacement,
    k: TokenPlacement,
    num_heads: int,
    budget: int = _SCORE_BUDGET,
    group_budget: int = _GROUP_BUDGET,
    *,
    causal_self: bool = False,
) -> list[tuple[int, int, int, int]]:
    """Rectangles ``(q_start, q_stop, k_start, k_stop)`` covering every sequence's (rows x keys).

    Consecutive sequences share a rectangle while ``num_heads * rows * keys`` stays within
    ``min(group_budget, budget)``; a sequence over ``budget`` on its own is split into query-row
    blocks. Sequences with no rows or no keys get no rectangle (their rows stay empty: out 0,
    LSE -inf). ``causal_self``: ``q`` and ``k`` are the same side under a causal mask, whose rows
    are in increasing position within each sequence (true of every TokenPlacement thdpack builds), so a row
    block of one sequence needs no key after its last row: the keys are cut there.
    """
    group_budget = min(group_budget, budget)
    blocks: list[tuple[int, int, int, int]] = []
    q0 = k0 = 0
    i, n = 0, len(q.counts)
    while i < n:
        rows, keys, j = q.counts[i], k.counts[i], i + 1
        while j < n and num_heads * (rows + q.counts[j]) * (keys + k.counts[j]) <= group_budget:
            rows, keys, j = rows + q.counts[j], keys + k.counts[j], j + 1
        if rows and keys:
            step = max(1, budget // (num_heads * keys))
            for a in range(0, rows, step):
                b = min(a + step, rows)
                cut = b if causal_self and j == i + 1 else keys
                blocks.append((q0 + a, q0 + b, k0, k0 + cut))
        q0, k0, i = q0 + rows, k0 + keys, j
    return blocks


def _visible(tile: Tile, qa: int, qb: int, ka: int, kb: int) -> torch.Tensor:
    """(rows, keys) bool of one block: :func:`thdpack.attention.masks.visible` over its pairs."""
    q, k = tile.q, tile.k
    return visible(
        q.seg_T[qa:qb, None], q.pos_T[qa:qb, None], k.seg_T[None, ka:kb], k.pos_T[None, ka:kb], k.valid_T[None, ka:kb],
        tile.causal,
    )  # fmt: skip


def _scores(
    q_TNH: torch.Tensor, k_TNH: torch.Tensor, mask_TT: torch.Tensor, scale: float, acc: torch.dtype
) -> torch.Tensor:
    """(Nkv, G, Tq, Tk) scaled scores in ``acc``; invisible pairs are -inf."""
    nkv = k_TNH.shape[1]
    q_TKGH = (q_TNH.to(acc) * scale).unflatten(1, (nkv, -1))
    s_KGQT = torch.einsum("qkgh,tkh->kgqt", q_TKGH, k_TNH.to(acc))
    return s_KGQT.masked_fill_(~mask_TT, float("-inf"))


def tile_forward(
    q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor, tile: Tile
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``tile.q``'s rows over ``tile.k``'s rows.

    Args:
        q_TNH: (Tq, Nq, H) queries, rows as described by ``tile.q``.
        k_TNH / v_TNH: (Tk, Nkv, H) / (Tk, Nkv, Hv) keys and values, rows as described by
            ``tile.k``; ``Nq % Nkv == 0`` (query head h uses KV head ``h // (Nq // Nkv)``).
        tile: the two sides, the mask type and the softmax scale.

    Returns:
        ``out_TNH`` (Tq, Nq, Hv) and ``lse_NT`` (Nq, Tq) natural-log LSE, both in the
        accumulation dtype (fp64 for fp64 inputs, else fp32); rows with no visible key are 0 / -inf.
    """
    acc = accumulation_dtype(q_TNH.dtype)
    tq, nq = q_TNH.shape[:2]
    out_TNH = q_TNH.new_zeros((tq, nq, v_TNH.shape[-1]), dtype=acc)
    lse_NT = q_TNH.new_full((nq, tq), float("-inf"), dtype=acc)
    for qa, qb, ka, kb in plan_blocks(tile.q, tile.k, nq, causal_self=tile.causal and tile.q is tile.k):
        s_KGQT = _scores(q_TNH[qa:qb], k_TNH[ka:kb], _visible(tile, qa, qb, ka, kb), tile.scale, acc)
        lse_KGQ = torch.logsumexp(s_KGQT, dim=-1)
        # rows with no visible key have lse -inf; measuring against 0 keeps P = exp(-inf) = 0
        p_KGQT = s_KGQT.sub_(lse_KGQ.masked_fill(torch.isneginf(lse_KGQ), 0.0).unsqueeze(-1)).exp_()
        o_QKGH = torch.einsum("kgqt,tkh->qkgh", p_KGQT, v_TNH[ka:kb].to(acc))
        out_TNH[qa:qb] = o_QKGH.flatten(1, 2)
        lse_NT[:, qa:qb] = lse_KGQ.flatten(0, 1)
    return out_TNH, lse_NT


def tile_backward(
    dout_TNH: torch.Tensor,
    q_TNH: torch.Tensor,
    k_TNH: torch.Tensor,
    v_TNH: torch.Tensor,
    lse_NT: torch.Tensor,
    delta_NT: torch.Tensor,
    tile: Tile,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradient contributions of one tile, given its rows' GLOBAL softmax statistics.

    Args:
        dout_TNH: (Tq, Nq, Hv) gradient of the final output rows.
        q_TNH, k_TNH, v_TNH, tile: as in :func:`tile_forward`.
        lse_NT: (Nq, Tq) the rows' final LSE over ALL their keys (not just this tile's).
        delta_NT: (Nq, Tq) ``rowsum(dout * out) - dlse`` with the final ``out`` and the incoming
            gradient of the returned LSE (0 when unused): ``merge.output_grads``.

    Returns:
        ``(dq_TNH, dk_TNH, dv_TNH)`` in the accumulation dtype; dK/dV already summed over each
        KV head's group of query heads. Summed over tiles covering all keys they are exact.
    """
    acc = accumulation_dtype(q_TNH.dtype)
    nkv = k_TNH.shape[1]
    dq_TNH = torch.zeros(q_TNH.shape, dtype=acc, device=q_TNH.device)
    dk_TNH = torch.zeros(k_TNH.shape, dtype=acc, device=k_TNH.device)
    dv_TNH = torch.zeros(v_TNH.shape, dtype=acc, device=v_TNH.device)
    lse_KGQ = lse_NT.to(acc).masked_fill(torch.isneginf(lse_NT), 0.0).unflatten(0, (nkv, -1))
    delta_KGQ = delta_NT.to(acc).unflatten(0, (nkv, -1))
    for qa, qb, ka, kb in plan_blocks(tile.q, tile.k, q_TNH.shape[1], causal_self=tile.causal and tile.q is tile.k):
        s_KGQT = _scores(q_TNH[qa:qb], k_TNH[ka:kb], _visible(tile, qa, qb, ka, kb), tile.scale, acc)
        p_KGQT = s_KGQT.sub_(lse_KGQ[..., qa:qb, None]).exp_()
        do_QKGH = dout_TNH[qa:qb].to(acc).unflatten(1, (nkv, -1))
        q_QKGH = q_TNH[qa:qb].to(acc).unflatten(1, (nkv, -1))
        k_TKH, v_TKH = k_TNH[ka:kb].to(acc), v_TNH[ka:kb].to(acc)
        dv_TNH[ka:kb] += torch.einsum("kgqt,qkgh->tkh", p_KGQT, do_QKGH)
        dp_KGQT = torch.einsum("qkgh,tkh->kgqt", do_QKGH, v_TKH)
        # dS = P * (dP - delta), with the softmax scale folded in once for both dQ and dK
        ds_KGQT = dp_KGQT.sub_(delta_KGQ[..., qa:qb, None]).mul_(p_KGQT).mul_(tile.scale)
        dq_TNH[qa:qb] = torch.einsum("kgqt,tkh->qkgh", ds_KGQT, k_TKH).flatten(1, 2)
        dk_TNH[ka:kb] += torch.einsum("kgqt,qkgh->tkh", ds_KGQT, q_QKGH)
    return dq_TNH, dk_TNH, dv_TNH
