"""Attention masks for backends without varlen kernels, all from the same THD metadata.

Every mask here is ``layout_mask``: query token ``q`` may attend key token ``k`` iff both belong
to the same sequence, ``k`` is not after ``q`` (when causal) and ``k`` is a real token. The
per-token ``TokenLayout`` (sequence index, position in the padded slot, real or padding) is
computed from ``cu_seqlens`` / ``cu_seqlens_padded`` alone, so it is correct in any storage
order: a global batch, a CP shard (chunks ``r`` and ``2W-1-r`` of every sequence), or a shard's
queries against all-gathered keys.

Padding queries attend the real tokens of their own sequence (never an empty row, so no NaN);
padding keys are never attended, so padding cannot reach a real token.

Legend: ``T`` tokens of a batch or shard (``Tq`` queries, ``Tk`` keys), ``N`` sequences,
``B`` rows and ``L`` row length of a BSHD batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from thdpack._optional import has_flex_attention
from thdpack.cp.partition import partition_indices
from thdpack.thd import SEQ_LENS_SENTINEL, sequence_lengths

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


@dataclass(frozen=True)
class TokenLayout:
    """Where each token of a (global or CP-sharded) THD batch sits, in its storage order.

    Attributes:
        seg: (T,) int64, the sequence index ``0..N-1``.
        pos: (T,) int64, the position inside the sequence's padded slot (0-based).
        valid: (T,) bool, ``pos < real length`` (False = padding).
    """

    seg: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor

    def __post_init__(self) -> None:
        if not (self.seg.dim() == 1 and self.seg.shape == self.pos.shape == self.valid.shape):
            raise ValueError(
                f"TokenLayout needs three (T,) tensors, got seg {tuple(self.seg.shape)}, "
                f"pos {tuple(self.pos.shape)}, valid {tuple(self.valid.shape)}"
            )


def token_layout(thd: Mapping[str, Any]) -> TokenLayout:
    """The ``TokenLayout`` of a THD batch, or of a CP shard (``thd["cp_size"]``, ``thd["cp_rank"]``).

    Reads only ``cu_seqlens`` ((N+1,) real boundaries), ``cu_seqlens_padded`` ((N+1,) slot
    boundaries, ``[-1] == T`` global) and, for a shard, ``cp_size`` / ``cp_rank``. The result
    is on ``cu_seqlens_padded``'s device, ``T / cp_size`` long for a shard.

    >>> cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    >>> cu_padded = torch.tensor([0, 4, 8], dtype=torch.int32)
    >>> layout = token_layout({"cu_seqlens": cu, "cu_seqlens_padded": cu_padded})
    >>> layout.seg.tolist(), layout.pos.tolist()
    ([0, 0, 0, 0, 1, 1, 1, 1], [0, 1, 2, 3, 0, 1, 2, 3])
    >>> layout.valid.int().tolist()
    [1, 1, 1, 0, 1, 1, 0, 0]
    >>> shard1 = token_layout({"cu_seqlens": cu, "cu_seqlens_padded": cu_padded, "cp_size": 2, "cp_rank": 1})
    >>> shard1.seg.tolist(), shard1.pos.tolist(), shard1.valid.int().tolist()
    ([0, 0, 1, 1], [1, 2, 1, 2], [1, 1, 1, 0])
    """
    for key in ("cu_seqlens", "cu_seqlens_padded"):
        if key not in thd:
            raise ValueError(f"token_layout needs {key}; build the batch with thdpack.to_thd")
    cu_padded_N1 = thd["cu_seqlens_padded"].to(torch.int64)
    real_N = thd["cu_seqlens"].to(torch.int64).diff()
    padded_N = cu_padded_N1.diff()
    if real_N.shape != padded_N.shape:
        raise ValueError(
            f"cu_seqlens has {real_N.numel() + 1} entries but cu_seqlens_padded has {padded_N.numel() + 1}"
        )
    T = int(cu_padded_N1[-1])
    device = cu_padded_N1.device
    seg_T = torch.repeat_interleave(torch.arange(padded_N.numel(), device=device), padded_N, output_size=T)
    pos_T = torch.arange(T, device=device) - cu_padded_N1[:-1][seg_T]
    valid_T = pos_T < real_N[seg_T]
    cp_size, cp_rank = thd.get("cp_size", 1), thd.get("cp_rank", 0)
    if cp_size > 1:
        local_T = partition_indices(thd["cu_seqlens_padded"], T, cp_size, cp_rank)
        seg_T, pos_T, valid_T = seg_T[local_T], pos_T[local_T], valid_T[local_T]
    return TokenLayout(seg=seg_T, pos=pos_T, valid=valid_T)


def layout_mask(q: TokenLayout, k: TokenLayout, *, causal: bool = True) -> torch.Tensor:
    """(Tq, Tk) bool, True = query ``i`` may attend key ``j``.

    ``q.seg[i] == k.seg[j]`` and ``k.valid[j]``, and ``q.pos[i] >= k.pos[j]`` when ``causal``.
    With ``q`` and ``k`` from the same batch (or ``q`` a shard and ``k`` its global batch), no
    row is empty as long as every sequence has at least one real token.
    """
    allowed_QK = (q.seg[:, None] == k.seg[None, :]) & k.valid[None, :]
    if causal:
        allowed_QK &= q.pos[:, None] >= k.pos[None, :]
    return allowed_QK


def block_causal_mask(thd: Mapping[str, Any], *, causal: bool = True) -> torch.Tensor:
    """(T, T) bool, True = may attend: ``layout_mask`` of the batch (or shard) against itself.

    Sequences of 3, 2 and 1 tokens, no padding:

    >>> cu = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    >>> print(mask_to_ascii(block_causal_mask({"cu_seqlens": cu, "cu_seqlens_padded": cu})))
    100000
    110000
    111000
    000100
    000110
    000001

    With padding (real lengths 3 and 1 in slots of 4): padding keys are never attended,
    padding queries see their own sequence's real tokens.

    >>> thd = {"cu_seqlens": torch.tensor([0, 3, 4], dtype=torch.int32),
    ...        "cu_seqlens_padded": torch.tensor([0, 4, 8], dtype=torch.int32)}
    >>> print(mask_to_ascii(block_causal_mask(thd)))
    10000000
    11000000
    11100000
    11100000
    00001000
    00001000
    00001000
    00001000
    """
    layout = token_layout(thd)
    return layout_mask(layout, layout, causal=causal)


def block_causal_bias(
    thd: Mapping[str, Any], dtype: torch.dtype = torch.float32, *, causal: bool = True
) -> torch.Tensor:
    """(T, T) additive bias: 0 where ``block_causal_mask`` allows, ``finfo(dtype).min`` elsewhere.

    For SDPA / eager kernels that take a float mask (``finfo.min``, not ``-inf``, so a kernel
    never computes ``-inf - -inf``).

    >>> cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    >>> block_causal_bias({"cu_seqlens": cu, "cu_seqlens_padded": cu}, torch.float16).tolist()
    [[0.0, -65504.0], [-65504.0, 0.0]]
    """
    if not dtype.is_floating_point:
        raise ValueError(f"block_causal_bias needs a floating dtype, got {dtype}")
    allowed_TT = block_causal_mask(thd, causal=causal)
    bias_TT = torch.zeros(allowed_TT.shape, dtype=dtype, device=allowed_TT.device)
    return bias_TT.masked_fill_(~allowed_TT, torch.finfo(dtype).min)


def segment_ids(batch: Mapping[str, Any]) -> torch.Tensor:
    """(B, L) int64 segment ids of a collated BSHD batch: ``1..k`` per sequence of a row, 0 on padding.

    LLaMA-Factory's packed-attention convention. Padding (CP padding inside a slot and the pack's
    tail) is read from ``seq_lens`` / ``seq_lens_padded``, never from token values.

    >>> batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 0]]),
    ...          "labels": torch.tensor([[6, -100, 8, 9, -100, -100]]),
    ...          "position_ids": torch.tensor([[0, 1, 0, 1, 2, 3]]),
    ...          "seq_lens": torch.tensor([[2, 3]]), "seq_lens_padded": torch.tensor([[2, 4]])}
    >>> segment_ids(batch).tolist()
    [[1, 1, 2, 2, 2, 0]]
    """
    real_N, padded_N = sequence_lengths(batch)
    B, L = batch["input_ids"].shape
    present_BS = batch["seq_lens_padded"] != SEQ_LENS_SENTINEL
    S = present_BS.shape[1]
    ordinal_N = (torch.arange(1, S + 1, device=present_BS.device).expand(B, S))[present_BS]
    seg_T = torch.repeat_interleave(ordinal_N, padded_N, output_size=B * L)
    starts_N = torch.cumsum(padded_N, 0) - padded_N
    pos_T = torch.arange(B * L, device=seg_T.device) - torch.repeat_interleave(starts_N, padded_N, output_size=B * L)
    real_T = torch.repeat_interleave(real_N, padded_N, output_size=B * L)
    return seg_T.masked_fill_(pos_T >= real_T, 0).view(B, L)


def flex_block_mask(
    thd: Mapping[str, Any],
    *,
    causal: bool = True,
    kv_layout: TokenLayout | None = None,
    block_size: int = 128,
) -> BlockMask:
    """A FlexAttention ``BlockMask`` equal to ``layout_mask(token_layout(thd), kv_layout)``.

    Queries are ``thd``'s tokens (a global batch or a CP shard); keys follow ``kv_layout``
    (default: the same tokens; pass the global batch's ``token_layout`` for a shard's queries
    against all-gathered keys). Built with ``torch.nn.attention.flex_attention.create_block_mask``
    on the metadata's device, for batch and heads broadcast (``B = H = None``).
    Raises ``ImportError`` when this torch has no FlexAttention (torch < 2.5).
    """
    if not has_flex_attention():
        raise ImportError(
            "flex_block_mask needs torch.nn.attention.flex_attention (torch >= 2.5); "
            f"torch {torch.__version__} lacks it: upgrade torch or use block_causal_mask"
        )
    from torch.nn.attention.flex_attention import create_block_mask

    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    q = token_layout(thd)
    k = q if kv_layout is None else kv_layout

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        allowed = (q.seg[q_idx] == k.seg[kv_idx]) & k.valid[kv_idx]
        if causal:
            allowed = allowed & (q.pos[q_idx] >= k.pos[kv_idx])
        return allowed

    return create_block_mask(
        mask_mod, None, None, q.seg.numel(), k.seg.numel(), device=q.seg.device, BLOCK_SIZE=block_size
    )


def mask_to_ascii(mask_QK: torch.Tensor) -> str:
    """A (Tq, Tk) bool mask as rows of ``1`` (may attend) and ``0``, for docs and debugging."""
    if mask_QK.dim() != 2:
        raise ValueError(f"mask_to_ascii takes a 2-D mask, got shape {tuple(mask_QK.shape)}")
    return "\n".join("".join("1" if x else "0" for x in row) for row in mask_QK.tolist())
