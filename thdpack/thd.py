"""THD batches: collate packs into a BSHD batch, flatten it to Transformer Engine's THD layout.

Data flow: ``packs -> collate -> (split_micro_batches) -> to_thd -> cp.shard -> attention``.
``thd_collate`` runs the first two steps in a DataLoader worker, so every piece of metadata
(including the Python-int ``max_seqlen``) is computed on the host, once, and the forward pass
never calls ``.item()``.

Legend: ``B`` rows (packs), ``L`` row length (pack_size), ``S`` most sequences in one row,
``T = B*L`` packed tokens, ``N`` sequences in the whole batch.

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

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

SEQ_LENS_SENTINEL = -1000
"""Fills ``seq_lens`` / ``seq_lens_padded`` rows past a pack's last sequence (NeMo's value)."""

PACK_KEYS = ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded")
"""Keys every pack carries (CONTRACT.md "Packs")."""

THD_METADATA_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "cp_size", "cp_rank")
"""Keys of a THD batch that describe the whole batch rather than one token each."""

_INT_TOKEN_KEYS = ("input_ids", "labels", "position_ids")
_LENGTH_KEYS = ("seq_lens", "seq_lens_padded")

THDBatch = dict[str, Any]
"""A THD batch: the module docstring's table; CP shards add ``cp_size`` and ``cp_rank``."""


def collate(packs: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack packs into a BSHD batch (NeMo's ``packed_sequence_thd_collater`` format).

    Args:
        packs: ``B >= 1`` packs of one length ``L``, each with ``input_ids``, ``labels``,
            ``position_ids`` ((L,) integers: tensors, numpy arrays or lists), ``seq_lens`` (real
            lengths) and ``seq_lens_padded`` (slot widths, ``sum == L``, each ``>=`` its real
            length). Any other key must be per-token (first dim ``L``) and is stacked too.

    Returns:
        ``input_ids``, ``labels``, ``position_ids``: (B, L) int64; ``seq_lens``,
        ``seq_lens_padded``: (B, S) int64, each row right-padded with ``SEQ_LENS_SENTINEL``
        (-1000); extra keys: (B, L, ...) in their own dtype.

    Raises ``ValueError`` naming the pack index and the offending value for an empty batch,
    missing keys, packs of different lengths or inconsistent lengths.

    >>> a = {"input_ids": [1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0],
    ...      "labels": [1, 2, 3, -100, 4, 5, 6, 7, 8] + [-100] * 7,
    ...      "position_ids": [0, 1, 2, 3] + list(range(12)),
    ...      "seq_lens": [3, 5], "seq_lens_padded": [4, 12]}
    >>> b = {"input_ids": [1, 2, 3, 0, 4, 5, 0, 0, 6] + [0] * 7,
    ...      "labels": [1, 2, 3, -100, 4, 5, -100, -100, 6] + [-100] * 7,
    ...      "position_ids": [0, 1, 2, 3, 0, 1, 2, 3] + list(range(8)),
    ...      "seq_lens": [3, 2, 1], "seq_lens_padded": [4, 4, 8]}
    >>> batch = collate([a, b])
    >>> batch["input_ids"].shape
    torch.Size([2, 16])
    >>> batch["seq_lens"].tolist(), batch["seq_lens_padded"].tolist()
    ([[3, 5, -1000], [3, 2, 1]], [[4, 12, -1000], [4, 4, 8]])
    """
    batch = _stack_packs(packs)
    _flat_sequence_lengths(batch["seq_lens"], batch["seq_lens_padded"], batch["input_ids"].shape[1])
    return batch


def to_thd(batch: Mapping[str, Any]) -> THDBatch:
    """Flatten a collated BSHD batch into a THD batch (the module docstring's table).

    Args:
        batch: ``collate``'s output: (B, L) ``input_ids``, ``labels``, ``position_ids``;
            (B, S) ``seq_lens`` and ``seq_lens_padded`` padded with -1000; other (B, L, ...)
            tensors are flattened to (T, ...); non-tensor values (``qkv_format``) pass through.
            A ``padding_mask`` already in ``batch`` (NeMo's token-value one) is replaced by the
            layout's.

    Returns:
        The THD batch. ``cu_seqlens`` counts REAL tokens (TE's convention, so the kernel skips
        padding); ``cu_seqlens_padded`` follows the storage. ``max_seqlen`` is the widest
        PADDED slot, not the longest real sequence: a kernel given a ``max_seqlen`` below a slot
        width may write out of bounds (cuDNN did, NeMo Automodel PR #2316), while a larger value
        only costs a little launch-grid slack. Tensors are views of ``batch`` where possible.

    ``padding_mask`` comes from the layout, never from token values, so a pad id that also
    occurs as content (GLM's eos) stays a real token:

    >>> batch = {"input_ids": torch.tensor([[7, 8, 0, 0, 9, 0, 0, 0]]),
    ...          "labels": torch.tensor([[8, 0, -100, -100, 0, -100, -100, -100]]),
    ...          "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]),
    ...          "seq_lens": torch.tensor([[3, 2]]), "seq_lens_padded": torch.tensor([[4, 4]])}
    >>> thd = to_thd(batch)
    >>> thd["cu_seqlens"].tolist(), thd["cu_seqlens_padded"].tolist(), thd["max_seqlen"]
    ([0, 3, 5], [0, 4, 8], 4)
    >>> thd["padding_mask"].int().tolist()
    [0, 0, 0, 1, 0, 0, 1, 1]
    """
    _check_bshd(batch)
    real_N, padded_N = _flat_sequence_lengths(
        batch["seq_lens"], batch["seq_lens_padded"], batch["input_ids"].shape[1]
    )
    return _flatten(batch, real_N, padded_N)


def thd_collate(packs: Sequence[Mapping[str, Any]]) -> THDBatch:
    """``to_thd(collate(packs))`` with one validation pass: a DataLoader ``collate_fn``.

    Use it as ``DataLoader(dataset, batch_size=B, collate_fn=thd_collate, pin_memory=True)``;
    the worker then computes ``cu_seqlens`` and ``max_seqlen`` on the host, and
    ``thd_to_device`` moves the batch without a host sync.
    """
    batch = _stack_packs(packs)
    real_N, padded_N = _flat_sequence_lengths(
        batch["seq_lens"], batch["seq_lens_padded"], batch["input_ids"].shape[1]
    )
    return _flatten(batch, real_N, padded_N)


def thd_to_device(
    thd: Mapping[str, Any], device: torch.device | str, *, non_blocking: bool = True
) -> THDBatch:
    """Move every tensor of a THD batch to ``device``; ``max_seqlen`` and other ints stay Python ints.

    ``non_blocking`` copies overlap with compute when the batch is in pinned memory
    (``DataLoader(pin_memory=True)``).
    """
    return {
        key: value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value
        for key, value in thd.items()
    }


def split_micro_batches(batch: Mapping[str, Any], num_chunks: int) -> list[dict[str, Any]]:
    """Cut a BSHD batch into ``num_chunks`` micro-batches of ``B // num_chunks`` consecutive rows.

    Each micro-batch equals ``collate`` of its packs: ``seq_lens`` / ``seq_lens_padded`` keep
    only as many columns as the micro-batch's fullest row. Unlike NeMo's
    ``split_batch_into_thd_chunks``, which floors ``B // num_chunks`` and silently drops the
    remainder rows, a ``B`` that ``num_chunks`` does not divide raises ``ValueError``.

    >>> batch = {"input_ids": torch.arange(12).view(3, 4), "labels": torch.arange(12).view(3, 4),
    ...          "position_ids": torch.tensor([[0, 1, 2, 3], [0, 1, 0, 1], [0, 0, 1, 2]]),
    ...          "seq_lens": torch.tensor([[4, -1000, -1000], [2, 2, -1000], [1, 1, 2]]),
    ...          "seq_lens_padded": torch.tensor([[4, -1000, -1000], [2, 2, -1000], [1, 1, 2]])}
    >>> [m["seq_lens"].tolist() for m in split_micro_batches(batch, 3)]
    [[[4]], [[2, 2]], [[1, 1, 2]]]
    >>> split_micro_batches(batch, 2)
    Traceback (most recent call last):
    ...
    ValueError: batch has B=3 rows, not divisible by num_chunks=2 ...
    """
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be an int >= 1, got {num_chunks!r}")
    _check_bshd(batch)
    B = batch["input_ids"].shape[0]
    if B % num_chunks != 0:
        raise ValueError(
            f"batch has B={B} rows, not divisible by num_chunks={num_chunks} (NeMo would silently drop "
            f"{B % num_chunks} rows); use a batch size that is a multiple of num_chunks"
        )
    rows = B // num_chunks
    chunks = []
    for c in range(num_chunks):
        chunk = {
            key: value[c * rows : (c + 1) * rows] if isinstance(value, torch.Tensor) else value
            for key, value in batch.items()
        }
        width = int((chunk["seq_lens_padded"] != SEQ_LENS_SENTINEL).sum(1).max())
        for key in _LENGTH_KEYS:
            chunk[key] = chunk[key][:, :width]
        chunks.append(chunk)
    return chunks


def sequence_lengths(batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The validated real and padded lengths of a collated BSHD batch, sentinels dropped.

    Returns ``(seq_lens_N, seq_lens_padded_N)``: (N,) int64 each, row-major over the batch
    (row 0's sequences first). Raises ``ValueError`` as ``collate`` does.

    >>> sequence_lengths({"input_ids": torch.zeros(2, 4, dtype=torch.long),
    ...                   "labels": torch.zeros(2, 4, dtype=torch.long),
    ...                   "position_ids": torch.zeros(2, 4, dtype=torch.long),
    ...                   "seq_lens": torch.tensor([[1, 2], [3, -1000]]),
    ...                   "seq_lens_padded": torch.tensor([[2, 2], [4, -1000]])})
    (tensor([1, 2, 3]), tensor([2, 2, 4]))
    """
    _check_bshd(batch)
    real_N, padded_N = _flat_sequence_lengths(
        batch["seq_lens"], batch["seq_lens_padded"], batch["input_ids"].shape[1]
    )
    return torch.from_numpy(real_N), torch.from_numpy(padded_N)


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
    missing = [k for k in (*_INT_TOKEN_KEYS, "padding_mask", *THD_METADATA_KEYS[:3]) if k not in thd]
    if missing:
        raise ValueError(f"THD batch lacks {missing}; build it with thdpack.to_thd / thd_collate")
    cu = _check_cu("cu_seqlens", thd["cu_seqlens"])
    cu_padded = _check_cu("cu_seqlens_padded", thd["cu_seqlens_padded"])
    if cu.shape != cu_padded.shape:
        raise ValueError(
            f"cu_seqlens has {cu.numel()} entries but cu_seqlens_padded has {cu_padded.numel()}; "
            "both need one entry per sequence plus one"
        )
    real_N, padded_N = cu.diff(), cu_padded.diff()
    over = real_N > padded_N
    if bool(over.any()):
        i = int(torch.nonzero(over)[0])
        raise ValueError(
            f"sequence {i} has {int(real_N[i])} real tokens but a padded slot of {int(padded_N[i])}; "
            "cu_seqlens must count real tokens and cu_seqlens_padded the slots that hold them"
        )
    max_seqlen = thd["max_seqlen"]
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(
            "max_seqlen must be a Python int (so the forward pass needs no .item()), "
            f"got {type(max_seqlen).__name__}"
        )
    widest = int(padded_N.max()) if padded_N.numel() else 0
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
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"sequence {i} has padded width {int(padded_N[i])}, not a multiple of "
                f"2*cp_size={2 * cp_size}; pack with cp_size={cp_size}"
            )
    local_T = T // cp_size
    for key, value in thd.items():
        if key in THD_METADATA_KEYS or not isinstance(value, torch.Tensor):
            continue
        if value.dim() == 0 or value.shape[0] != local_T:
            where = f"T / cp_size = {T} / {cp_size}" if cp_size > 1 else "T = cu_seqlens_padded[-1]"
            raise ValueError(
                f"{key} has shape {tuple(value.shape)}; per-token tensors need {local_T} rows ({where})"
            )
    for key in _INT_TOKEN_KEYS:
        if thd[key].dtype.is_floating_point or thd[key].dtype.is_complex or thd[key].dtype == torch.bool:
            raise TypeError(f"{key} must be an integer tensor, got {thd[key].dtype}")
    if thd["padding_mask"].dtype != torch.bool:
        raise TypeError(
            f"padding_mask must be a bool tensor (True = padding), got {thd['padding_mask'].dtype}"
        )


def _check_cu(name: str, cu: Any) -> torch.Tensor:
    """Validate one cu_seqlens tensor; return it on the host as int64."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (what TE and flash-attn take), got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with N+1 >= 2 entries, got shape {tuple(cu.shape)}")
    cu = cu.detach().to("cpu", torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(cu[0])}")
    drops = cu.diff() < 0
    if bool(drops.any()):
        i = int(torch.nonzero(drops)[0]) + 1
        raise ValueError(
            f"{name} must be non-decreasing; it drops at entry {i} ({int(cu[i - 1])} -> {int(cu[i])})"
        )
    return cu


def _stack_packs(packs: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack the packs' per-token keys and pad their length lists; checks keys, lengths and dtypes."""
    if isinstance(packs, Mapping) or not isinstance(packs, Sequence):
        raise TypeError(f"collate takes a sequence of packs (dicts), got {type(packs).__name__}")
    if len(packs) == 0:
        raise ValueError("collate got an empty batch; pass at least one pack")
    keys = list(packs[0].keys())
    for i, pack in enumerate(packs):
        missing = [k for k in PACK_KEYS if k not in pack]
        if missing:
            raise ValueError(f"pack {i} lacks {missing}; a pack needs {list(PACK_KEYS)}")
        if pack.keys() != packs[0].keys():
            raise ValueError(
                f"pack {i} has keys {sorted(pack.keys())} but pack 0 has {sorted(keys)}; "
                "every pack in a batch needs the same keys"
            )
    L = len(packs[0]["input_ids"])
    if L == 0:
        raise ValueError("pack 0 has 0 tokens; packs need pack_size >= 1")
    batch: dict[str, torch.Tensor] = {}
    for key in keys:
        if key in _LENGTH_KEYS:
            continue
        rows = [_as_tensor(pack[key], i, key) for i, pack in enumerate(packs)]
        for i, row in enumerate(rows):
            if row.dim() == 0 or row.shape[0] != L:
                shape = tuple(row.shape)
                raise ValueError(
                    f"pack {i} has {key} of shape {shape} but pack 0 has {L} tokens; every pack in a batch "
                    "needs the same pack_size, and collate stacks only per-token keys (first dim = pack_size)"
                )
        stacked = torch.stack(rows)
        if key in _INT_TOKEN_KEYS:
            if stacked.dtype.is_floating_point or stacked.dtype.is_complex or stacked.dtype == torch.bool:
                raise TypeError(f"{key} must hold integers, got {stacked.dtype}")
            stacked = stacked.to(torch.int64)
        batch[key] = stacked
    lengths = {key: [_as_lengths(p[key], i, key) for i, p in enumerate(packs)] for key in _LENGTH_KEYS}
    for i, (real, padded) in enumerate(zip(lengths["seq_lens"], lengths["seq_lens_padded"], strict=True)):
        if real.ndim != 1 or padded.shape != real.shape:
            raise ValueError(
                f"pack {i} has seq_lens {real.tolist()} and seq_lens_padded {padded.tolist()}; both must be "
                "1-D with one entry per sequence"
            )
    S = max(len(real) for real in lengths["seq_lens"])
    for key in _LENGTH_KEYS:
        matrix_BS = np.full((len(packs), S), SEQ_LENS_SENTINEL, dtype=np.int64)
        for i, row in enumerate(lengths[key]):
            matrix_BS[i, : len(row)] = row
        batch[key] = torch.from_numpy(matrix_BS)
    return batch


def _as_lengths(value: Any, pack_index: int, key: str) -> np.ndarray:
    """A pack's seq_lens / seq_lens_padded as an int64 numpy array (metadata is tiny: numpy is cheapest)."""
    array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"pack {pack_index} has {key} of dtype {array.dtype}; lengths must be integers")
    return array.astype(np.int64, copy=False)


def _as_tensor(value: Any, pack_index: int, key: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(
            f"pack {pack_index} has {key} of type {type(value).__name__}, not a tensor: {err}"
        ) from err


def _check_bshd(batch: Mapping[str, Any]) -> None:
    """Keys and shapes of a collated batch (values are checked by ``_flat_sequence_lengths``)."""
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
        if key in _LENGTH_KEYS:
            if value.dim() != 2 or value.shape[0] != B or value.shape != batch["seq_lens_padded"].shape:
                raise ValueError(
                    f"{key} has shape {tuple(value.shape)}; seq_lens and seq_lens_padded must both be (B, S) "
                    f"with B={B}"
                )
        elif value.dim() < 2 or value.shape[:2] != (B, L):
            raise ValueError(
                f"{key} has shape {tuple(value.shape)}; per-token tensors must be (B, L, ...) "
                f"= ({B}, {L}, ...)"
            )


def _flat_sequence_lengths(
    seq_lens_BS: torch.Tensor, seq_lens_padded_BS: torch.Tensor, L: int
) -> tuple[np.ndarray, np.ndarray]:
    """Validate the (B, S) length matrices; return the real and padded lengths, (N,) int64, row-major.

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


def _cumsum_from_zero(lengths_N: np.ndarray) -> torch.Tensor:
    """(N+1,) int32 ``[0] + cumsum(lengths)``."""
    cu = np.zeros(len(lengths_N) + 1, dtype=np.int32)
    np.cumsum(lengths_N, out=cu[1:])
    return torch.from_numpy(cu)


def _layout_padding_mask(real_N: np.ndarray, padded_N: np.ndarray) -> torch.Tensor:
    """(T,) bool, True past each slot's real length: runs of (real: False, padding: True), slot by slot."""
    runs_2N = np.empty(2 * len(real_N), dtype=np.int64)
    runs_2N[0::2] = real_N
    runs_2N[1::2] = padded_N - real_N
    is_padding_2N = np.zeros(2 * len(real_N), dtype=bool)
    is_padding_2N[1::2] = True
    return torch.from_numpy(np.repeat(is_padding_2N, runs_2N))


def _flatten(batch: Mapping[str, Any], real_N: np.ndarray, padded_N: np.ndarray) -> THDBatch:
    """The THD batch of a checked BSHD batch; metadata computed on the host, moved to the batch's device."""
    B, L = batch["input_ids"].shape
    T = B * L
    device = batch["input_ids"].device
    thd: THDBatch = {
        "input_ids": batch["input_ids"].reshape(T),
        "labels": batch["labels"].reshape(T),
        "position_ids": batch["position_ids"].reshape(T),
        "cu_seqlens": _cumsum_from_zero(real_N).to(device),
        "cu_seqlens_padded": _cumsum_from_zero(padded_N).to(device),
        "max_seqlen": int(padded_N.max()) if len(padded_N) else 0,
        "padding_mask": _layout_padding_mask(real_N, padded_N).to(device),
    }
    for key, value in batch.items():
        if key in thd or key in _LENGTH_KEYS:
            continue
        thd[key] = value.reshape(T, *value.shape[2:]) if isinstance(value, torch.Tensor) else value
    return thd
