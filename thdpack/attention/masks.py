"""Attention masks for backends without varlen kernels, all from the same THD metadata.

:func:`visible` is the one mask rule: query ``q`` sees key ``k`` iff both are in one sequence,
``k`` is real and, when causal, not after ``q``. The per-token facts come from the batch's record,
so the rule holds in any storage order (a batch, a CP shard, a shard against all-gathered keys).
Padding queries see their sequence's real tokens (never an empty row, so no NaN); padding keys
are never seen.

Legend: ``T`` tokens of a batch or shard (``Tq`` queries, ``Tk`` keys), ``S`` sequences,
``B`` rows and ``L`` row length of a BSHD batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from thdpack._optional import has_flex_attention
from thdpack.cp.partition import local_placement
from thdpack.thd.carriage import thd_meta
from thdpack.thd.format import SEQ_LENS_SENTINEL, bshd_meta
from thdpack.thd.tokens import TokenPlacement, global_placement

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


def visible(
    q_seg: torch.Tensor,
    q_pos: torch.Tensor,
    k_seg: torch.Tensor,
    k_pos: torch.Tensor,
    k_valid: torch.Tensor,
    causal: bool,
) -> torch.Tensor:
    """THE mask rule, elementwise (broadcasting): query (q_seg, q_pos) may attend key (k_seg, k_pos)
    iff both are in the same sequence, the key is a real token and, when ``causal``, the key is
    not after the query. The dense masks, FlexAttention's ``mask_mod`` and the math kernel's
    tiles all call it.

    >>> seg, pos = torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0])
    >>> visible(seg[:, None], pos[:, None], seg[None], pos[None], torch.tensor([True, True, False])[None], True).int()
    tensor([[1, 0, 0],
            [1, 1, 0],
            [0, 0, 0]], dtype=torch.int32)
    """
    allowed = (q_seg == k_seg) & k_valid
    return allowed & (q_pos >= k_pos) if causal else allowed


def token_layout(thd: Mapping[str, Any]) -> TokenPlacement:
    """The :class:`TokenPlacement` of a THD batch, or of a CP shard (``thdpack.cp.shard``'s, or a
    mapping with ``cp_size`` / ``cp_rank`` keys), on ``cu_seqlens_padded``'s device (``T / cp_size``
    rows for a shard).

    >>> cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    >>> cu_padded = torch.tensor([0, 4, 8], dtype=torch.int32)
    >>> layout = token_layout({"cu_seqlens": cu, "cu_seqlens_padded": cu_padded})
    >>> layout.seg_T.tolist(), layout.pos_T.tolist()
    ([0, 0, 0, 0, 1, 1, 1, 1], [0, 1, 2, 3, 0, 1, 2, 3])
    >>> layout.valid_T.int().tolist()
    [1, 1, 1, 0, 1, 1, 0, 0]
    >>> shard1 = token_layout({"cu_seqlens": cu, "cu_seqlens_padded": cu_padded, "cp_size": 2, "cp_rank": 1})
    >>> shard1.seg_T.tolist(), shard1.pos_T.tolist(), shard1.valid_T.int().tolist()
    ([0, 0, 1, 1], [1, 2, 1, 2], [1, 1, 1, 0])
    """
    for key in ("cu_seqlens", "cu_seqlens_padded"):
        if key not in thd:
            raise ValueError(f"token_layout needs {key}; build the batch with thdpack.to_thd")
    return local_placement(thd_meta(thd), thd["cu_seqlens_padded"].device)


def layout_mask(q: TokenPlacement, k: TokenPlacement, *, causal: bool = True) -> torch.Tensor:
    """(Tq, Tk) bool, True = query ``i`` may attend key ``j`` (:func:`visible` of every pair).

    With ``q`` and ``k`` from the same batch (or ``q`` a shard and ``k`` its global batch), no
    row is empty as long as every sequence has at least one real token.
    """
    return visible(q.seg_T[:, None], q.pos_T[:, None], k.seg_T[None, :], k.pos_T[None, :], k.valid_T[None, :], causal)


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
    meta = bshd_meta(batch)
    B, L = batch["input_ids"].shape
    rows = global_placement(meta, batch["input_ids"].device)
    present_BS = batch["seq_lens_padded"] != SEQ_LENS_SENTINEL
    # each row's sequences count 1, 2, ...: the global sequence index minus the row's first one, plus 1
    first_B = torch.cumsum(present_BS.sum(1), 0) - present_BS.sum(1)
    ordinal_T = rows.seg_T - first_B.to(rows.device).repeat_interleave(L) + 1
    return ordinal_T.masked_fill_(~rows.valid_T, 0).view(B, L)


def flex_block_mask(
    thd: Mapping[str, Any],
    *,
    causal: bool = True,
    kv_layout: TokenPlacement | None = None,
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
        return visible(q.seg_T[q_idx], q.pos_T[q_idx], k.seg_T[kv_idx], k.pos_T[kv_idx], k.valid_T[kv_idx], causal)

    return create_block_mask(mask_mod, None, None, q.num_rows, k.num_rows, device=q.device, BLOCK_SIZE=block_size)


def mask_to_ascii(mask_QK: torch.Tensor) -> str:
    """A (Tq, Tk) bool mask as rows of ``1`` (may attend) and ``0``, for docs and debugging."""
    if mask_QK.dim() != 2:
        raise ValueError(f"mask_to_ascii takes a 2-D mask, got shape {tuple(mask_QK.shape)}")
    return "\n".join("".join("1" if x else "0" for x in row) for row in mask_QK.tolist())
