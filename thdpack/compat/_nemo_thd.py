"""NeMo AutoModel drop-ins for BSHD -> THD conversion and Transformer Engine CP sharding:
``process_input_for_thd``, ``split_batch_into_thd_chunks``, ``make_cp_batch_for_te`` (current
generation: ``cu_seqlens`` from real lengths, trailing-pad absorption, ``padding_mask`` from
the layout), each thdpack's core call (``to_thd``, ``split_micro_batches``, ``cp.shard``) plus
NeMo's names and quirks.

Legend: ``B`` rows, ``L`` row length, ``T = B*L`` tokens, ``S`` sequences, ``C`` chunks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from thdpack.compat._nemo_errors import NemoKeyError
from thdpack.cp.partition import shard
from thdpack.thd.batch import split_micro_batches, to_thd
from thdpack.thd.carriage import META_KEY, thd_meta
from thdpack.thd.cu import cu_from_lengths
from thdpack.thd.format import SEQ_LENS_SENTINEL
from thdpack.thd.tokens import real_rows

TOKEN_KEYS = ("input_ids", "labels", "position_ids", "padding_mask")
LENGTH_KEYS = ("seq_lens", "seq_lens_padded")


class CPMesh(Protocol):
    """What ``make_cp_batch_for_te`` needs of a context-parallel ``DeviceMesh``."""

    def size(self) -> int: ...

    def get_group(self) -> Any: ...


def _require_seq_lens(batch: Mapping[str, Any]) -> None:
    """NeMo reads ``batch["seq_lens"]`` (``KeyError`` when absent); thdpack refuses it missing or None."""
    if batch.get("seq_lens") is None:
        raise NemoKeyError(
            "batch['seq_lens'] is missing or None: thdpack derives cu_seqlens and padding_mask from the pack "
            "layout, never from token values; collate with packed_sequence_thd_collater"
        )


def _check_widths(batch: Mapping[str, Any]) -> tuple[int, int]:
    """(B, L) of ``input_ids``; every per-token key must match it (NeMo reshapes blindly)."""
    input_ids = batch["input_ids"]
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() not in (2, 3):
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a (B, L) tensor of ids or (B, L, H) embeddings, got {shape}")
    rows, width = input_ids.shape[:2]
    labels, position_ids = batch.get("labels"), batch.get("position_ids")
    if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != (rows, width):
        shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(
            f"labels has shape {shape} but input_ids is ({rows}, {width}, ...); give one (already shifted) label "
            "per token: labels must be (B, L) like input_ids"
        )
    if position_ids is not None and not (
        tuple(position_ids.shape) == (rows, width)
        or (position_ids.dim() == 3 and position_ids.shape[1:] == (rows, width))
    ):
        raise ValueError(
            f"position_ids has shape {tuple(position_ids.shape)} but input_ids is ({rows}, {width}, ...); "
            "position_ids must be (B, L), or (R, B, L) for mRoPE, or None"
        )
    for key in LENGTH_KEYS:
        value = batch.get(key)
        if value is not None and (value.dim() != 2 or value.shape[0] != rows):
            raise ValueError(
                f"{key} has shape {tuple(value.shape)} but input_ids has B={rows} rows; {key} must be (B, S)"
            )
    return rows, width


def _core_lengths(batch: Mapping[str, Any], sentinel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``seq_lens`` and ``seq_lens_padded`` (``seq_lens`` where None) with thdpack's filler, -1000."""
    seq_lens = batch["seq_lens"]
    slots = batch.get("seq_lens_padded")
    slots = seq_lens if slots is None else slots
    if sentinel != SEQ_LENS_SENTINEL:
        seq_lens = torch.where(seq_lens == sentinel, SEQ_LENS_SENTINEL, seq_lens)
        slots = torch.where(slots == sentinel, SEQ_LENS_SENTINEL, slots)
    return seq_lens, slots


def _core_batch(batch: Mapping[str, Any], width: int, sentinel: int) -> tuple[dict[str, Any], int]:
    """The BSHD batch ``thdpack.to_thd`` takes, and the tokens of padding at the end of the LAST row
    that NeMo's ``seq_lens_padded`` leave unlisted (NeMo allows that there only; thdpack's packs
    count them in the last slot). mRoPE positions (R, B, L) go in as per-token (B, L, R)."""
    seq_lens, slots = _core_lengths(batch, sentinel)
    slots = slots.detach().cpu().clone().to(torch.int64)
    listed = torch.where(slots == SEQ_LENS_SENTINEL, 0, slots).sum(1)
    unlisted = width - int(listed[-1])
    last = int((slots[-1] != SEQ_LENS_SENTINEL).sum()) - 1
    if unlisted > 0 and last >= 0:
        slots[-1, last] += unlisted
    position_ids = batch.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3:
        position_ids = position_ids.permute(1, 2, 0)
    core = {
        "input_ids": batch["input_ids"],
        "labels": batch["labels"],
        "position_ids": position_ids,
        "seq_lens": seq_lens,
        "seq_lens_padded": slots,
    }
    return core, max(unlisted, 0)


def process_input_for_thd(
    batch: Mapping[str, Any], seq_lens_padding_value: int = SEQ_LENS_SENTINEL, padding_token_id: int = 0
) -> dict[str, Any]:
    """NeMo's ``process_input_for_thd`` (current generation): a collated BSHD batch -> THD.

    ``thdpack.to_thd`` flattens the batch, validates its lengths and takes ``padding_mask`` from
    the layout; what remains is NeMo's format.

    Args:
        batch: ``input_ids`` (B, L) (or (B, L, H) embeddings), ``labels`` (B, L),
            ``position_ids`` (B, L), (R, B, L) for mRoPE, or None, ``seq_lens`` and
            ``seq_lens_padded`` (B, S) with ``seq_lens_padding_value`` as filler.
        seq_lens_padding_value: the filler, -1000.
        padding_token_id: see the module docstring of ``thdpack.compat.nemo`` (unused).

    Returns:
        A dict, keys in NeMo's order: ``input_ids`` (T,) / (T, H), ``position_ids`` (T,) /
        (R, 1, T), ``cu_seqlens`` (S+1,) int32 from real lengths, ``labels`` (T,),
        ``padding_mask`` (T,) bool (True = padding), ``cu_seqlens_padded`` (S+1,) int32 only when it
        differs from ``cu_seqlens``, ``max_seqlen`` 0-dim int32 = max slot of ``cu_seqlens``, then
        every other key of ``batch`` except ``seq_lens`` / ``seq_lens_padded``. When the only
        padding is at the very end, the last boundary absorbs it (``cu_seqlens[-1] = T``) and no
        ``cu_seqlens_padded`` is emitted. Raises ``ValueError`` for any width other than
        ``input_ids``' and for lengths that do not match the rows, and for a missing ``seq_lens``
        (NeMo then falls back to token values) ``NemoKeyError``, a ``ValueError`` and the
        ``KeyError`` NeMo raises for a missing key.

    >>> batch = {"input_ids": torch.tensor([[1, 2, 3, 99, 4, 5], [6, 7, 8, 9, 10, 11]]),
    ...          "labels": torch.tensor([[2, 3, 99, 4, 5, 6], [7, 8, 9, 10, 11, 12]]),
    ...          "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5]]),
    ...          "seq_lens": torch.tensor([[3, 2], [6, -1000]]),
    ...          "seq_lens_padded": torch.tensor([[4, 2], [6, -1000]])}
    >>> out = process_input_for_thd(batch)
    >>> out["cu_seqlens"].tolist(), out["cu_seqlens_padded"].tolist(), int(out["max_seqlen"])
    ([0, 3, 5, 11], [0, 4, 6, 12], 6)
    >>> out["padding_mask"].nonzero().flatten().tolist()
    [3]
    """
    _require_seq_lens(batch)
    rows, width = _check_widths(batch)
    total = rows * width
    core, unlisted = _core_batch(batch, width, seq_lens_padding_value)
    thd = to_thd(core)
    meta = thd_meta(thd)
    device = batch["seq_lens"].device
    # NeMo's boundaries: cu_seqlens from real lengths; cu_seqlens_padded ends where the listed slots end
    real_S = meta.lengths_S.copy()
    listed_S = meta.lengths_padded_S.copy()
    if unlisted and len(listed_S):
        listed_S[-1] -= unlisted
    has_padded = batch.get("seq_lens_padded") is not None
    if has_padded and len(real_S) and np.array_equal(real_S[:-1], listed_S[:-1]) and real_S.sum() < total:
        real_S[-1] += total - real_S.sum()  # only the last sequence has padding: it absorbs it (TE's cheaper path)
        listed_S = real_S
    position_ids = thd["position_ids"]
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2:  # mRoPE: (T, R) -> NeMo's (R, 1, T)
        position_ids = position_ids.T.unsqueeze(1)
    out: dict[str, Any] = {
        "input_ids": thd["input_ids"].reshape(total, -1).squeeze(-1),
        "position_ids": position_ids,
        "cu_seqlens": cu_from_lengths(real_S, device),
        "labels": thd["labels"],
        "padding_mask": thd["padding_mask"],
    }
    if has_padded and not np.array_equal(listed_S, real_S):
        out["cu_seqlens_padded"] = cu_from_lengths(listed_S, device)
    if len(real_S):
        out["max_seqlen"] = torch.tensor(int(real_S.max()), dtype=torch.int32, device=device)
    for key, value in batch.items():
        if key not in out and key not in LENGTH_KEYS:
            out[key] = value
    return out


def _stack_padded(rows: list[torch.Tensor], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=rows[0].dtype, device=rows[0].device)
    for c, row in enumerate(rows):
        out[c, : len(row)] = row
    return out


def split_batch_into_thd_chunks(
    batch: Mapping[str, Any],
    num_chunks: int,
    seq_lens_padding_value: int = SEQ_LENS_SENTINEL,
    padding_token_id: int = 0,
) -> dict[str, Any]:
    """NeMo's ``split_batch_into_thd_chunks``: ``process_input_for_thd`` on C groups of rows.

    Args:
        batch: a collated BSHD batch of B rows.
        num_chunks: C; ``<= 1`` is ``process_input_for_thd(batch)``; ``B % C != 0`` raises
            ``ValueError`` (NeMo silently drops the remainder rows).
        seq_lens_padding_value: the filler, -1000.
        padding_token_id: unused (see ``process_input_for_thd``).

    Returns:
        ``thdpack.thd.split_micro_batches`` chunks of ``B/C`` consecutive rows, each through
        ``process_input_for_thd``, stacked: ``input_ids``, ``labels``, ``position_ids``,
        ``padding_mask`` to (C, T/C), ``cu_seqlens`` to (C, K) int32 right-padded with the filler,
        ``cu_seqlens_padded`` likewise when any chunk has one (others contribute ``cu_seqlens``),
        ``max_seqlen`` to (C,) int32; non-tensor keys kept. mRoPE position ids raise ``ValueError``,
        a missing ``seq_lens`` ``NemoKeyError``.

    >>> batch = {"input_ids": torch.arange(8).reshape(2, 4), "labels": torch.arange(8).reshape(2, 4),
    ...          "position_ids": torch.tensor([[0, 1, 2, 3], [0, 1, 0, 1]]),
    ...          "seq_lens": torch.tensor([[3, -1000], [2, 2]]),
    ...          "seq_lens_padded": torch.tensor([[4, -1000], [2, 2]])}
    >>> out = split_batch_into_thd_chunks(batch, 2)
    >>> out["cu_seqlens"].tolist(), out["max_seqlen"].tolist()
    ([[0, 4, -1000], [0, 2, 4]], [4, 2])
    """
    if num_chunks <= 1:
        return process_input_for_thd(batch, seq_lens_padding_value, padding_token_id)
    _require_seq_lens(batch)
    position_ids = batch.get("position_ids")
    if position_ids is not None and position_ids.dim() == 3:
        raise ValueError("split_batch_into_thd_chunks does not support 3-D (mRoPE) position_ids; use num_chunks=1")
    rows = _check_widths(batch)[0]
    # the core's filler (so each chunk keeps only its own columns); a missing seq_lens_padded stays missing
    seq_lens, slots = _core_lengths(batch, seq_lens_padding_value)
    parts = split_micro_batches({**batch, "seq_lens": seq_lens, "seq_lens_padded": slots}, num_chunks)
    per = rows // num_chunks
    chunks = []
    for c, part in enumerate(parts):
        if batch.get("seq_lens_padded") is None:
            part["seq_lens_padded"] = None
        try:
            chunks.append(process_input_for_thd(part, SEQ_LENS_SENTINEL, padding_token_id))
        except ValueError as err:
            raise ValueError(f"chunk {c} (rows {c * per}-{(c + 1) * per - 1}): {err}") from err
    out: dict[str, Any] = {
        "input_ids": torch.stack([c["input_ids"] for c in chunks]),
        "labels": torch.stack([c["labels"] for c in chunks]),
        "position_ids": None if position_ids is None else torch.stack([c["position_ids"] for c in chunks]),
        "cu_seqlens": _stack_padded([c["cu_seqlens"] for c in chunks], seq_lens_padding_value),
        "padding_mask": torch.stack([c["padding_mask"] for c in chunks]),
    }
    if any("cu_seqlens_padded" in c for c in chunks):
        out["cu_seqlens_padded"] = _stack_padded(
            [c.get("cu_seqlens_padded", c["cu_seqlens"]) for c in chunks], seq_lens_padding_value
        )
    if all("max_seqlen" in c for c in chunks):
        out["max_seqlen"] = torch.stack([c["max_seqlen"] for c in chunks])
    for key, value in chunks[0].items():
        if key not in out and not isinstance(value, torch.Tensor):
            out[key] = value
    return out


def _shard_for_te(
    batch: Mapping[str, Any], cp_size: int, cp_rank: int, qkv_format: str, sentinel: int
) -> tuple[dict[str, Any], torch.Tensor]:
    """One THD chunk -> this rank's tokens by ``thdpack.cp.shard``; NeMo's names on the way out
    (padded cu_seqlens as ``cu_seqlens``, a 0-dim int32 ``max_seqlen``, no ``cu_seqlens_padded``)."""
    cu = batch["cu_seqlens"]
    cu = cu[cu != sentinel].to(torch.int32)
    listed = batch.get("cu_seqlens_padded", batch["cu_seqlens"])  # a chunk's may end in the filler
    cu_padded = listed[listed != sentinel].to(torch.int32)
    total = batch["input_ids"].shape[0]
    if len(cu_padded) and int(cu_padded[-1]) != total:
        given = "cu_seqlens_padded" if "cu_seqlens_padded" in batch else "cu_seqlens"
        raise ValueError(
            f"the batch's {given} ends at {int(cu_padded[-1])} but its input_ids hold {total} tokens; {given}[-1] "
            "must be the token count (the padded boundaries of the THD batch, as process_input_for_thd gives them)"
        )
    position_ids = batch.get("position_ids")
    mrope = isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3  # (R, 1, T): tokens last
    tokens: dict[str, Any] = {"cu_seqlens": cu, "cu_seqlens_padded": cu_padded}
    for key in TOKEN_KEYS:  # the caller's tensors first: a width error names one of them
        value = batch.get(key)
        if isinstance(value, torch.Tensor):
            tokens[key] = value.permute(2, 0, 1) if key == "position_ids" and mrope else value
    tokens["local_index"] = torch.arange(total, device=batch["input_ids"].device)
    if "padding_mask" not in tokens:  # a THD batch made elsewhere: the mask comes from its layout
        meta = thd_meta(tokens)
        tokens["padding_mask"] = torch.from_numpy(~real_rows(meta.lengths_padded_S, meta.lengths_S))
    local = shard(tokens, cp_size, cp_rank)
    out = {k: v for k, v in batch.items() if k not in ("attention_mask", "cu_seqlens_padded", META_KEY)}
    for key in TOKEN_KEYS:
        if key in local:
            value = local[key]
            out[key] = value.permute(1, 2, 0).contiguous() if key == "position_ids" and mrope else value.contiguous()
    for key in ("input_ids", "labels", "position_ids"):
        value = out.get(key)
        if isinstance(value, torch.Tensor) and not value.is_floating_point():  # embeddings keep their dtype
            out[key] = value.to(torch.int64)
    out["padding_mask"] = out["padding_mask"].bool()
    out.update(
        cu_seqlens=listed.to(torch.int32).contiguous(),
        max_seqlen=torch.tensor(thd_meta(local).max_seqlen, dtype=torch.int32, device=cu_padded.device),
        qkv_format=qkv_format,
        cp_size=cp_size,
        cp_rank=cp_rank,
    )
    return out, local["local_index"]


def make_cp_batch_for_te(
    cp_mesh: CPMesh | None,
    batch: Mapping[str, Any],
    qkv_format: str = "thd",
    padding_token_id: int = 0,
    num_chunks: int = 1,
    seq_lens_padding_value: int = SEQ_LENS_SENTINEL,
    return_local_indices: bool = False,
) -> dict[str, Any] | tuple[dict[str, Any], torch.Tensor | None]:
    """NeMo's ``make_cp_batch_for_te``: BSHD batch -> THD -> this CP rank's shard for TE.

    Args:
        cp_mesh: a ``DeviceMesh`` (or anything with ``size()`` and ``get_group()``); the rank is
            ``torch.distributed.get_rank(group=cp_mesh.get_group())``. None or of size 1: the THD
            batch (``split_batch_into_thd_chunks``) is returned unsharded.
        batch: a collated BSHD batch (``packed_sequence_thd_collater``).
        qkv_format: recorded in the output, as NeMo does.
        padding_token_id: accepted for NeMo's signature, unused (the layout says what is padding).
        num_chunks: above 1, each chunk is sharded and the shards stacked (``cu_seqlens`` keeps the
            -1000 filler).
        seq_lens_padding_value: the filler, -1000.
        return_local_indices: also return this rank's global token indices (an ``arange`` without
            CP; None with chunks).

    Returns:
        The shard, every token tensor re-indexed with ``partition_indices`` (rank r keeps chunks r
        and 2*cp-1-r of every sequence) and, as NeMo does, ``cu_seqlens`` the *padded* boundaries
        (global, int32), ``max_seqlen`` the largest padded sequence (global), ``cu_seqlens_padded``
        dropped, ``qkv_format``, ``cp_size``, ``cp_rank`` added; ``input_ids`` (if integer),
        ``labels`` and ``position_ids`` int64. With ``return_local_indices``, ``(shard, indices)``.
        Padded lengths not divisible by ``2*cp_size`` raise ``ValueError`` (TE silently duplicates
        and drops tokens).
    """
    if qkv_format != "thd":
        raise ValueError(f"Currently only 'thd' format is supported, got: {qkv_format}")
    already_thd = "cu_seqlens" in batch and "seq_lens" not in batch
    if already_thd and num_chunks > 1:
        raise ValueError("num_chunks > 1 needs the collated BSHD batch (with seq_lens), not a THD batch")
    thd = dict(batch) if already_thd else split_batch_into_thd_chunks(batch, num_chunks, seq_lens_padding_value)
    cp_size = 1 if cp_mesh is None else int(cp_mesh.size())
    if cp_size <= 1:
        if not return_local_indices:
            return thd
        tokens = thd["input_ids"]
        local = torch.arange(tokens.shape[0], device=tokens.device) if num_chunks <= 1 else None
        return thd, local
    cp_rank = dist.get_rank(group=cp_mesh.get_group())
    if num_chunks <= 1:
        out, index = _shard_for_te(thd, cp_size, cp_rank, qkv_format, seq_lens_padding_value)
        return (out, index) if return_local_indices else out
    shards = []
    for c in range(num_chunks):
        chunk = {
            k: v[c] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == num_chunks else v
            for k, v in thd.items()
        }
        shards.append(_shard_for_te(chunk, cp_size, cp_rank, qkv_format, seq_lens_padding_value)[0])
    out = {
        key: None if shards[0].get(key) is None else torch.stack([s[key] for s in shards])
        for key in ("input_ids", "labels", "position_ids")
    }
    out.update(
        cu_seqlens=torch.stack([s["cu_seqlens"] for s in shards]),
        max_seqlen=torch.stack([s["max_seqlen"] for s in shards]),
        padding_mask=torch.stack([s["padding_mask"] for s in shards]),
        qkv_format=qkv_format,
        cp_size=cp_size,
        cp_rank=cp_rank,
    )
    return (out, None) if return_local_indices else out
