"""The BSHD and THD batch formats: their keys, the -1000 sentinel, and their validation.

Legend: ``B`` rows (packs), ``L`` row length (pack_size), ``S`` most sequences in one row,
``T = B*L`` packed tokens, ``N`` sequences in the whole batch.

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
``cu_seqlens``         (N+1,) int32         ``[0] + cumsum(real lengths)`` (TE's ``cu_seqlens``)
``cu_seqlens_padded``  (N+1,) int32         ``[0] + cumsum(slot widths)``; ``[-1] == T``
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


def validate_thd(thd: Mapping[str, Any]) -> None:
    """Check a THD batch (global, or a CP shard carrying ``cp_size`` / ``cp_rank``) once, on the host.

    Checks: required keys; ``input_ids``, ``labels``, ``position_ids`` integer and ``padding_mask``
    bool; every per-token tensor has ``T`` rows (``T / cp_size`` for a shard); ``cu_seqlens`` and
    ``cu_seqlens_padded`` (N+1,) int32, ``[0] == 0``, non-decreasing, real ``<=`` padded per
    sequence, ``cu_seqlens_padded[-1] == T``; ``max_seqlen`` an int ``>=`` every padded width;
    for a shard, every padded width a multiple of ``2*cp_size``. Raises ``ValueError`` /
    ``TypeError`` saying what is wrong and how to fix it. Tensors on an accelerator are
    copied to the host for the checks (one sync), so validate before moving the batch.
    """
    missing = [k for k in (*INT_TOKEN_KEYS, "padding_mask", *THD_METADATA_KEYS[:3]) if k not in thd]
    if missing:
        raise ValueError(f"THD batch lacks {missing}; build it with thdpack.to_thd / thd_collate")
    cu = _check_cu("cu_seqlens", thd["cu_seqlens"])
    cu_padded = _check_cu("cu_seqlens_padded", thd["cu_seqlens_padded"])
    if cu.shape != cu_padded.shape:
        raise ValueError(
            f"cu_seqlens has {cu.size} entries but cu_seqlens_padded has {cu_padded.size}; "
            "both need one entry per sequence plus one"
        )
    real_N, padded_N = np.diff(cu), np.diff(cu_padded)
    over = real_N > padded_N
    if over.any():
        i = int(np.argmax(over))
        raise ValueError(
            f"sequence {i} has {real_N[i]} real tokens but a padded slot of {padded_N[i]}; "
            "cu_seqlens must count real tokens and cu_seqlens_padded the slots that hold them"
        )
    max_seqlen = thd["max_seqlen"]
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(
            f"max_seqlen must be a Python int (so the forward pass needs no .item()), got {type(max_seqlen).__name__}"
        )
    widest = int(padded_N.max()) if padded_N.size else 0
    if max_seqlen < widest:
        raise ValueError(
            f"max_seqlen={max_seqlen} is below the widest padded slot ({widest}); kernels may then write "
            "out of bounds; use max(diff(cu_seqlens_padded))"
        )
    T = int(cu_padded[-1])
    cp_size, cp_rank = thd.get("cp_size", 1), thd.get("cp_rank", 0)
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be an int >= 1, got {cp_size!r}")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, {cp_size}), got {cp_rank!r}")
    if cp_size > 1:
        bad = padded_N % (2 * cp_size) != 0
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"sequence {i} has padded width {padded_N[i]}, not a multiple of "
                f"2*cp_size={2 * cp_size}; pack with cp_size={cp_size}"
            )
    local_T = T // cp_size
    for key, value in thd.items():
        if key in THD_METADATA_KEYS or not isinstance(value, torch.Tensor):
            continue
        if value.dim() == 0 or value.shape[0] != local_T:
            where = f"T / cp_size = {T} / {cp_size}" if cp_size > 1 else "T = cu_seqlens_padded[-1]"
            raise ValueError(f"{key} has shape {tuple(value.shape)}; per-token tensors need {local_T} rows ({where})")
    for key in INT_TOKEN_KEYS:
        if thd[key].dtype.is_floating_point or thd[key].dtype.is_complex or thd[key].dtype == torch.bool:
            raise TypeError(f"{key} must be an integer tensor, got {thd[key].dtype}")
    if thd["padding_mask"].dtype != torch.bool:
        raise TypeError(f"padding_mask must be a bool tensor (True = padding), got {thd['padding_mask'].dtype}")


def _check_cu(name: str, cu: Any) -> np.ndarray:
    """Validate one cu_seqlens tensor; return it on the host as int64 numpy."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (what TE and flash-attn take), got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with N+1 >= 2 entries, got shape {tuple(cu.shape)}")
    host = cu.detach().cpu().numpy().astype(np.int64)
    if host[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {host[0]}")
    drops = np.diff(host) < 0
    if drops.any():
        i = int(np.argmax(drops)) + 1
        raise ValueError(f"{name} must be non-decreasing; it drops at entry {i} ({host[i - 1]} -> {host[i]})")
    return host


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


def flat_sequence_lengths(
    seq_lens_BS: torch.Tensor, seq_lens_padded_BS: torch.Tensor, L: int
) -> tuple[np.ndarray, np.ndarray]:
    """Validate a BSHD batch's length matrices; return its real and padded lengths.

    Args:
        seq_lens_BS, seq_lens_padded_BS: (B, S) integer, each row's lengths then the sentinel.
        L: the row length; every row's padded lengths must sum to it.

    Returns:
        ``(real_N, padded_N)``: (N,) int64 numpy arrays, row-major, sentinels dropped.

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
    negative = present_BS & ((real_BS < 0) | (padded_BS < 0))
    if negative.any():
        b, s = np.argwhere(negative)[0]
        raise ValueError(
            f"pack {b}: sequence {s} has seq_lens={real_BS[b, s]}, seq_lens_padded={padded_BS[b, s]}; "
            "lengths must be >= 0"
        )
    over = present_BS & (real_BS > padded_BS)
    if over.any():
        b, s = np.argwhere(over)[0]
        raise ValueError(
            f"pack {b}: sequence {s} has seq_lens={real_BS[b, s]} > seq_lens_padded={padded_BS[b, s]}; "
            "a slot must hold its sequence (seq_lens_padded is seq_lens rounded up, plus the pack's tail "
            "padding)"
        )
    row_sums_B = np.where(present_BS, padded_BS, 0).sum(1)
    wrong = row_sums_B != L
    if wrong.any():
        b = np.argwhere(wrong)[0][0]
        raise ValueError(
            f"pack {b}: seq_lens_padded={padded_BS[b][present_BS[b]].tolist()} sums to {row_sums_B[b]}, "
            f"not the pack length {L}; the pack's tail padding belongs to its last entry"
        )
    return real_BS[present_BS], padded_BS[present_BS]
