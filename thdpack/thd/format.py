"""The BSHD and THD batch formats: their keys, the -1000 sentinel, and their validation.

Legend: ``B`` rows (packs), ``L`` row length (pack_size), ``S`` most sequences in one row,
``T = B*L`` packed tokens, ``S`` sequences (of the whole batch, or the most in one row for the
(B, S) length matrices).

BSHD batch (``thdpack.collate``): ``input_ids``, ``labels``, ``position_ids`` (B, L) int64;
``seq_lens`` (real lengths) and ``seq_lens_padded`` (slot widths) (B, S) int64, each row
right-padded with ``SEQ_LENS_SENTINEL``; extra per-token keys (B, L, ...).

THD batch (a plain ``dict``; CONTRACT.md "THD batch"):

=====================  ===================  ===========================================
key                    shape, dtype         meaning
=====================  ===================  ===========================================
``input_ids``          (T,) int64           all rows flattened, row-major
``labels``             (T,) int64           already shifted; -100 on padding
``position_ids``       (T,) int64           restart at 0 per sequence, run on through padding
``cu_seqlens``         (S+1,) int32         ``[0] + cumsum(real lengths)`` (TE's ``cu_seqlens``)
``cu_seqlens_padded``  (S+1,) int32         ``[0] + cumsum(slot widths)``; ``[-1] == T``
``max_seqlen``         Python int           the widest padded slot (see ``to_thd``)
``padding_mask``       (T,) bool            True = padding, from the layout only
any other key          (T, ...)             per-token extras (``loss_mask``), flattened alike
=====================  ===================  ===========================================

Sequence ``i`` occupies storage ``[cu_seqlens_padded[i], cu_seqlens_padded[i+1])``; its
``cu_seqlens[i+1] - cu_seqlens[i]`` real tokens are a prefix of that slot.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from thdpack.thd.meta import CU_KEYS, ThdMeta, thd_meta

SEQ_LENS_SENTINEL = -1000
"""Fills ``seq_lens`` / ``seq_lens_padded`` rows past a pack's last sequence (NeMo's value)."""

PACK_KEYS = ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded")
"""Keys every pack carries (CONTRACT.md "Packs")."""

THD_METADATA_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "cp_size", "cp_rank")
"""Keys of a THD batch that describe the whole batch rather than one token each."""

INT_TOKEN_KEYS = ("input_ids", "labels", "position_ids")
LENGTH_KEYS = ("seq_lens", "seq_lens_padded")

THDBatch = dict[str, Any]
"""A THD batch: this module's table; CP shards add ``cp_size`` and ``cp_rank``."""


def validate_thd(thd: Mapping[str, Any]) -> ThdMeta:
    """Check a THD batch (global, or a CP shard carrying ``cp_size`` / ``cp_rank``); return its record.

    The metadata is checked by the one validator (:func:`thdpack.thd.meta.thd_meta`: ``cu_seqlens``
    and ``cu_seqlens_padded`` (S+1,), ``[0] == 0``, non-decreasing, real ``<=`` padded per sequence,
    ``max_seqlen`` an int ``>=`` every padded width, under CP every padded width a multiple of
    ``2*cp_size``); here in addition: the required keys, both ``cu`` tensors int32 (what TE and
    flash-attn take), ``input_ids`` / ``labels`` / ``position_ids`` integer, ``padding_mask`` bool,
    and every per-token tensor ``T`` rows (``T / cp_size`` for a shard). Raises ``ValueError`` /
    ``TypeError`` saying what is wrong and how to fix it. Tensors on an accelerator are copied to
    the host for the checks (one sync) unless thdpack made the batch, so validate before moving it.
    """
    missing = [k for k in (*INT_TOKEN_KEYS, "padding_mask", *THD_METADATA_KEYS[:3]) if k not in thd]
    if missing:
        raise ValueError(f"THD batch lacks {missing}; build it with thdpack.to_thd / thd_collate")
    meta = thd_meta(thd)
    for key in CU_KEYS:
        if thd[key].dtype != torch.int32:
            raise TypeError(f"{key} must be int32 (what TE and flash-attn take), got {thd[key].dtype}")
    for key, value in thd.items():
        if key in THD_METADATA_KEYS or not isinstance(value, torch.Tensor):
            continue
        if value.dim() == 0 or value.shape[0] != meta.local_tokens:
            cp_size = meta.cp_size
            where = f"T / cp_size = {meta.total_tokens} / {cp_size}" if cp_size > 1 else "T = cu_seqlens_padded[-1]"
            raise ValueError(
                f"{key} has shape {tuple(value.shape)}; per-token tensors need {meta.local_tokens} rows ({where})"
            )
    for key in INT_TOKEN_KEYS:
        if thd[key].dtype.is_floating_point or thd[key].dtype.is_complex or thd[key].dtype == torch.bool:
            raise TypeError(f"{key} must be an integer tensor, got {thd[key].dtype}")
    if thd["padding_mask"].dtype != torch.bool:
        raise TypeError(f"padding_mask must be a bool tensor (True = padding), got {thd['padding_mask'].dtype}")
    return meta


def check_bshd(batch: Mapping[str, Any]) -> None:
    """Check the keys and shapes of a BSHD batch; ``flat_sequence_lengths`` checks its lengths."""
    missing = [k for k in PACK_KEYS if k not in batch]
    if missing:
        raise ValueError(f"batch lacks {missing}; build it with thdpack.collate")
    input_ids = batch["input_ids"]
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must be a (B, L) tensor, got {getattr(input_ids, 'shape', type(input_ids).__name__)}"
        )
    B, L = input_ids.shape
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            continue
        if key in LENGTH_KEYS:
            if value.dim() != 2 or value.shape[0] != B or value.shape != batch["seq_lens_padded"].shape:
                raise ValueError(
                    f"{key} has shape {tuple(value.shape)}; seq_lens and seq_lens_padded must both be (B, S) with B={B}"
                )
        elif value.dim() < 2 or value.shape[:2] != (B, L):
            raise ValueError(
                f"{key} has shape {tuple(value.shape)}; per-token tensors must be (B, L, ...) = ({B}, {L}, ...)"
            )


def bshd_meta(seq_lens_BS: torch.Tensor, seq_lens_padded_BS: torch.Tensor, L: int) -> ThdMeta:
    """Validate a BSHD batch's length matrices; return the record of its THD form.

    Args:
        seq_lens_BS, seq_lens_padded_BS: (B, S) integer, each row's lengths then the sentinel.
        L: the row length; every row's padded lengths must sum to it.

    Returns:
        The batch's :class:`ThdMeta` (sequences row-major, sentinels dropped; ``max_seqlen`` the
        widest slot). Its per-sequence checks are ``ThdMeta.from_lengths``'s, naming the pack.

    Runs in numpy on the host: a few dozen tiny checks cost microseconds there, tens of
    microseconds as torch ops.
    """
    real_BS = seq_lens_BS.detach().cpu().numpy().astype(np.int64, copy=False)
    padded_BS = seq_lens_padded_BS.detach().cpu().numpy().astype(np.int64, copy=False)
    present_BS = padded_BS != SEQ_LENS_SENTINEL
    mismatch = present_BS != (real_BS != SEQ_LENS_SENTINEL)
    if mismatch.any():
        b, s = np.argwhere(mismatch)[0]
        raise ValueError(
            f"pack {b}: seq_lens[{s}]={real_BS[b, s]} but seq_lens_padded[{s}]={padded_BS[b, s]}; "
            f"both must hold a length there or both the sentinel {SEQ_LENS_SENTINEL}"
        )
    gap = present_BS[:, 1:] & ~present_BS[:, :-1]
    if gap.any():
        b = np.argwhere(gap)[0][0]
        raise ValueError(
            f"pack {b}: seq_lens_padded={padded_BS[b].tolist()} has a length after the sentinel "
            f"{SEQ_LENS_SENTINEL}; the sentinel may only fill the end of a row"
        )

    def where(s: int) -> str:  # only on an error: which pack and which of its sequences
        pack_S, column_S = np.nonzero(present_BS)
        return f"pack {pack_S[s]}: sequence {column_S[s]}"

    meta = ThdMeta.from_lengths(real_BS[present_BS], padded_BS[present_BS], where=where, copy=False)
    row_sums_B = np.where(present_BS, padded_BS, 0).sum(1)
    wrong = row_sums_B != L
    if wrong.any():
        b = np.argwhere(wrong)[0][0]
        raise ValueError(
            f"pack {b}: seq_lens_padded={padded_BS[b][present_BS[b]].tolist()} sums to {row_sums_B[b]}, "
            f"not the pack length {L}; the pack's tail padding belongs to its last entry"
        )
    return meta
