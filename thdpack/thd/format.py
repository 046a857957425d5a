"""The BSHD and THD batch formats: their keys, the -1000 sentinel, and their validation.

A BSHD batch (``thdpack.collate``) stacks packs into (B, L) rows with (B, S) length matrices
padded by ``SEQ_LENS_SENTINEL``; a THD batch (``thdpack.to_thd``) flattens the rows to (T,) and
describes the sequences by ``cu_seqlens`` / ``cu_seqlens_padded`` (CONTRACT.md "THD batch"; the
table of keys is in docs/concepts.md). Sequence ``i`` occupies
``[cu_seqlens_padded[i], cu_seqlens_padded[i+1])``, its real tokens a prefix of that slot.

Legend: ``B`` rows (packs), ``L`` row length (pack_size), ``T = B*L`` packed tokens, ``S``
sequences (of the whole batch, or the most in one row for the (B, S) length matrices).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from thdpack.thd.carriage import META_KEY, thd_meta
from thdpack.thd.cu import CU_KEYS
from thdpack.thd.meta import EntryGroups, ThdMeta

SEQ_LENS_SENTINEL = -1000
"""Fills ``seq_lens`` / ``seq_lens_padded`` rows past a pack's last sequence (NeMo's value)."""

PACK_KEYS = ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded")
"""Keys every pack carries (CONTRACT.md "Packs")."""

THD_METADATA_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", META_KEY, "cp_size", "cp_rank")
"""Keys of a THD batch that describe the whole batch rather than one token each (``cp_size`` /
``cp_rank``: those of a CP shard made elsewhere)."""

INT_TOKEN_KEYS = ("input_ids", "labels", "position_ids")
LENGTH_KEYS = ("seq_lens", "seq_lens_padded")
PLACEMENT_KEYS = ("cp_group_size", "cp_group_start")
"""Per-entry keys of the packs of a per-sequence CP placement (``thdpack.layout.placement``): each
entry's group size (1 = whole on one rank) and first rank; the batch's record takes them."""
A2A_KEY = "cp_a2a"
"""Per-entry key of the packs of a ``cp_placement="auto"`` plan: 1 on every entry of a pack the
attention runs by all-to-all, 0 on the others' (with the placement's keys; the record takes it)."""
ENTRY_KEYS = (*LENGTH_KEYS, *PLACEMENT_KEYS, A2A_KEY)
"""Keys with one value per entry of a pack (a pack's ``(S,)``, a BSHD batch's ``(B, S)``)."""

THDBatch = dict[str, Any]
"""A THD batch: this module's table."""


def validate_thd(thd: Mapping[str, Any]) -> ThdMeta:
    """Check a THD batch (global, or a CP shard); return its record.

    Args:
        thd: the batch (``thdpack.to_thd``'s keys, or another framework's with the same meaning).

    Returns:
        Its ``ThdMeta``.

    The layout is checked by its record (:func:`thdpack.thd.carriage.thd_meta`: ``cu_seqlens`` and
    ``cu_seqlens_padded`` (S+1,), ``[0] == 0``, non-decreasing, real ``<=`` padded per sequence,
    ``max_seqlen`` an int ``>=`` every padded width, under CP every padded width a multiple of
    ``2*cp_size``; a batch thdpack made carries it, checked once), and so are both ``cu``
    tensors int32 (what TE and flash-attn take) and every per-token tensor ``T`` rows (``T /
    cp_size`` for a shard); here in addition: the required keys, ``input_ids`` / ``labels`` /
    ``position_ids`` integer tensors, ``padding_mask`` bool. Raises ``ValueError`` / ``TypeError``
    saying what is wrong and how to fix it.

    >>> from thdpack.thd.batch import thd_collate
    >>> pack = {"input_ids": [5, 6, 7, 0], "labels": [6, 7, -100, -100], "position_ids": [0, 1, 2, 3],
    ...         "seq_lens": [3], "seq_lens_padded": [4]}
    >>> validate_thd(thd_collate([pack]))
    ThdMeta(lengths=(3,), lengths_padded=(4,), cp_size=1, cp_rank=0, max_seqlen=4)
    """
    missing = [k for k in (*INT_TOKEN_KEYS, "padding_mask", *CU_KEYS, "max_seqlen") if k not in thd]
    if missing:
        raise ValueError(f"THD batch lacks {missing}; build it with thdpack.to_thd / thd_collate")
    meta = thd_meta(thd)
    for key in CU_KEYS:
        meta.cu_tensor(key)
    check_token_rows(thd, meta)
    for key in INT_TOKEN_KEYS:
        value = thd[key]
        if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dtype in _NOT_INTEGER:
            raise TypeError(f"{key} must be an integer tensor, got {getattr(value, 'dtype', type(value).__name__)}")
    if not isinstance(thd["padding_mask"], torch.Tensor) or thd["padding_mask"].dtype != torch.bool:
        found = getattr(thd["padding_mask"], "dtype", type(thd["padding_mask"]).__name__)
        raise TypeError(f"padding_mask must be a bool tensor (True = padding), got {found}")
    return meta


_NOT_INTEGER = (torch.bool, torch.complex64, torch.complex128)


def check_token_rows(thd: Mapping[str, Any], meta: ThdMeta) -> None:
    """Every per-token tensor of ``thd`` has one row per token of its record ``meta``
    (:meth:`ThdMeta.check_token_count`)."""
    for key, value in thd.items():
        if key not in THD_METADATA_KEYS and isinstance(value, torch.Tensor):
            meta.check_token_count(value.shape[0] if value.dim() else 0, key)


def check_bshd(batch: Mapping[str, Any]) -> None:
    """Check the keys and shapes of a BSHD batch; ``bshd_meta`` checks its lengths."""
    missing = [k for k in PACK_KEYS if k not in batch]
    if missing:
        raise ValueError(f"batch lacks {missing}; build it with thdpack.collate")
    input_ids = batch["input_ids"]
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() < 2:
        raise ValueError(
            "input_ids must be a (B, L) tensor of token ids (or (B, L, H) input embeddings), got "
            f"{getattr(input_ids, 'shape', type(input_ids).__name__)}"
        )
    B, L = input_ids.shape[:2]
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            continue
        if key in ENTRY_KEYS:
            if value.dim() != 2 or value.shape[0] != B or value.shape != batch["seq_lens_padded"].shape:
                raise ValueError(
                    f"{key} has shape {tuple(value.shape)}; seq_lens, seq_lens_padded (and the CP placement's "
                    f"cp_group_size / cp_group_start) must all be (B, S) with B={B}"
                )
        elif value.dim() < 2 or value.shape[:2] != (B, L):
            raise ValueError(
                f"{key} has shape {tuple(value.shape)}; per-token tensors must be (B, L, ...) = ({B}, {L}, ...)"
            )


def bshd_meta(batch: Mapping[str, Any]) -> ThdMeta:
    """Validate a BSHD batch's per-entry matrices; return the record of its THD form.

    Args:
        batch: ``input_ids`` (B, L, ...) (only its shape is read); ``seq_lens`` and
            ``seq_lens_padded`` (B, S) integer, each row's lengths then the sentinel; every row's
            padded lengths must sum to ``L``. Packs of a per-sequence CP placement also carry
            ``cp_group_size`` / ``cp_group_start`` (B, S) alike: the batch is then laid out for the
            CP size the groups cover (every rank has its padding entry), and every rank of every
            pack must hold ``L / cp_size`` tokens (``CpLayout.check``).

    Returns:
        The batch's :class:`ThdMeta` (sequences row-major, sentinels dropped; ``max_seqlen`` the
        widest slot; a placed batch's groups). Its per-sequence checks are
        ``ThdMeta.from_lengths``'s, naming the pack.

    Runs in numpy on the host: a few dozen tiny checks cost microseconds there, tens of
    microseconds as torch ops.
    """
    L = batch["input_ids"].shape[1]
    real_BS = _host(batch["seq_lens"])
    padded_BS = _host(batch["seq_lens_padded"])
    present_BS = padded_BS != SEQ_LENS_SENTINEL
    placed = {key: _host(batch[key]) for key in (*PLACEMENT_KEYS, A2A_KEY) if key in batch}
    for key, matrix_BS in [("seq_lens", real_BS), *placed.items()]:
        mismatch = present_BS != (matrix_BS != SEQ_LENS_SENTINEL)
        if mismatch.any():
            b, s = np.argwhere(mismatch)[0]
            raise ValueError(
                f"pack {b}: {key}[{s}]={matrix_BS[b, s]} but seq_lens_padded[{s}]={padded_BS[b, s]}; "
                f"both must hold a value there or both the sentinel {SEQ_LENS_SENTINEL}"
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

    real_S, padded_S = real_BS[present_BS], padded_BS[present_BS]
    groups, pack_S = _placement_groups(placed, real_BS, present_BS) if placed else (None, None)
    meta = ThdMeta.from_lengths(real_S, padded_S, where=where, copy=False, groups=groups, pack_S=pack_S)
    row_sums_B = np.where(present_BS, padded_BS, 0).sum(1)
    wrong = row_sums_B != L
    if wrong.any():
        b = np.argwhere(wrong)[0][0]
        raise ValueError(
            f"pack {b}: seq_lens_padded={padded_BS[b][present_BS[b]].tolist()} sums to {row_sums_B[b]}, "
            f"not the pack length {L}; the pack's tail padding belongs to its last entry"
            + (" (to the padding entries of a CP placement)" if groups is not None else "")
        )
    return meta


def _host(matrix: torch.Tensor) -> np.ndarray:
    return matrix.detach().cpu().numpy().astype(np.int64, copy=False)


def _placement_groups(
    placed: Mapping[str, np.ndarray], real_BS: np.ndarray, present_BS: np.ndarray
) -> tuple[EntryGroups, np.ndarray]:
    """The entries' CP groups of a placed batch (``placed``: its ``PLACEMENT_KEYS`` matrices) and
    the pack of each entry (``ThdMeta.from_lengths`` checks them per pack). The CP size is the
    number of padding entries of every pack (real length 0: one per rank, ``PackPlacement.layout``),
    so that a group that reaches past the last rank is named as such, not read as more ranks."""
    missing = [key for key in PLACEMENT_KEYS if key not in placed]
    if missing:
        raise ValueError(f"the batch has {sorted(placed)} but lacks {missing}; a CP placement needs both keys")
    size_BS, start_BS = placed["cp_group_size"], placed["cp_group_start"]
    ranks_B = (present_BS & (real_BS == 0)).sum(1)
    if (ranks_B != ranks_B[0]).any():
        b = int(np.argmax(ranks_B != ranks_B[0]))
        raise ValueError(
            f"pack {b} is placed over {ranks_B[b]} CP ranks but pack 0 over {ranks_B[0]} (a placed pack ends with "
            "one padding entry, of real length 0, per rank); the packs of a batch share one CP size"
        )
    cp_size = int(ranks_B[0])
    if cp_size < 1:
        raise ValueError(
            "pack 0 carries a CP placement (cp_group_size / cp_group_start) but no padding entry (real length 0, "
            "one per CP rank); lay placed packs out with build_pack / assemble_pack(..., placement=...)"
        )
    a2a_BS = placed.get(A2A_KEY)
    a2a_S = None if a2a_BS is None else a2a_BS[present_BS]
    return EntryGroups(size_BS[present_BS], start_BS[present_BS], cp_size, a2a_S), np.nonzero(present_BS)[0]
