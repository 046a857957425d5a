"""THD batches: collate packs into a BSHD batch, flatten it to Transformer Engine's THD layout.

``packs -> collate -> (split_micro_batches) -> to_thd -> cp.shard -> attention``: ``thd_collate``
runs the first steps in a DataLoader worker, so the metadata (the Python-int ``max_seqlen``
included) is computed on the host once and the forward pass never calls ``.item()``. Every builder
validates the lengths once and returns the batch with its record, which attention, masks,
sharding and the loss take instead of validating again.

Legend: ``B`` rows (packs), ``L`` row length (pack_size), ``T = B*L`` packed tokens, ``S``
sequences (of the whole batch; the (B, S) length matrices have as many columns as the fullest row).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from thdpack.layout.rules import IGNORE_INDEX
from thdpack.thd.carriage import attach_meta, thd_meta
from thdpack.thd.cu import cu_from_lengths
from thdpack.thd.format import (
    ENTRY_KEYS,
    INT_TOKEN_KEYS,
    LENGTH_KEYS,
    PACK_KEYS,
    SEQ_LENS_SENTINEL,
    THDBatch,
    bshd_meta,
    check_bshd,
)
from thdpack.thd.meta import ThdMeta
from thdpack.thd.tokens import real_rows

__all__ = ["collate", "sequence_lengths", "split_micro_batches", "thd_collate", "thd_to_device", "to_thd"]


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
    bshd_meta(batch)
    return batch


def to_thd(batch: Mapping[str, Any]) -> THDBatch:
    """Flatten a collated BSHD batch into a THD batch (the table in ``thdpack.thd.format``).

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
        ``thd_meta`` is the batch's validated record (``thdpack.thd.meta``), which every later
        step takes from the batch instead of validating it again.

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
    >>> thd["thd_meta"]
    ThdMeta(lengths=(3, 2), lengths_padded=(4, 4), cp_size=1, cp_rank=0, max_seqlen=4)
    """
    check_bshd(batch)
    return _flatten(batch, bshd_meta(batch))


def thd_collate(packs: Sequence[Mapping[str, Any]]) -> THDBatch:
    """``to_thd(collate(packs))`` with one validation pass: a DataLoader ``collate_fn``.

    Use it as ``DataLoader(dataset, batch_size=B, collate_fn=thd_collate, pin_memory=True)``;
    the worker then computes ``cu_seqlens`` and ``max_seqlen`` on the host, and
    ``thd_to_device`` moves the batch without a host sync.

    Args:
        packs: ``B`` packs of one ``pack_size`` (``thdpack.packing`` makes them).

    Returns:
        The THD batch (``T = B * pack_size`` tokens) with its validated record.

    A label other than -100 on a padding row (past a sequence's real length, as ``seq_lens``
    says) raises ``ValueError`` naming the pack and the position: the loss would train on a row
    that attention treats as padding. (``to_thd`` takes a batch as given, as NeMo's
    ``process_input_for_thd``, whose drop-in it serves.)
    """
    batch = _stack_packs(packs)
    thd = _flatten(batch, bshd_meta(batch))
    _check_padding_labels(thd["labels"], thd["padding_mask"], batch)
    return thd


def thd_to_device(thd: Mapping[str, Any], device: torch.device | str, *, non_blocking: bool = True) -> THDBatch:
    """Move every tensor of a THD batch to ``device``; ``max_seqlen`` and other ints stay Python ints.

    Args:
        thd: a THD batch or a CP shard.
        device: where to.
        non_blocking: copies that overlap with compute when the batch is in pinned memory
            (``DataLoader(pin_memory=True)``, ``thd_pin_memory``).

    Returns:
        The batch on ``device`` with its record, which describes the moved tensors, so nothing on
        the device is read back to validate it again.
    """
    return _copy_tensors(thd, lambda t: t.to(device, non_blocking=non_blocking))


def thd_pin_memory(thd: Mapping[str, Any]) -> THDBatch:
    """Page-locked copies of a THD batch's tensors (needs CUDA), so that ``thd_to_device(...,
    non_blocking=True)`` overlaps the copy with compute; the batch's record moves along."""
    return _copy_tensors(thd, lambda t: t.pin_memory())


def _copy_tensors(thd: Mapping[str, Any], copy: Callable[[torch.Tensor], torch.Tensor]) -> THDBatch:
    meta = thd_meta(thd) if "cu_seqlens" in thd else None
    out = {key: copy(value) if isinstance(value, torch.Tensor) else value for key, value in thd.items()}
    if meta is not None:
        attach_meta(out, meta)
    return out


def split_micro_batches(batch: Mapping[str, Any], num_chunks: int) -> list[dict[str, Any]]:
    """Cut a BSHD batch into ``num_chunks`` micro-batches of ``B // num_chunks`` consecutive rows.

    Args:
        batch: a ``collate`` batch of ``B`` rows.
        num_chunks: micro-batches; must divide ``B`` (NeMo's ``split_batch_into_thd_chunks``
            floors ``B // num_chunks`` and silently drops the remainder rows: here it raises).

    Returns:
        ``num_chunks`` BSHD batches, each equal to ``collate`` of its packs (``seq_lens`` /
        ``seq_lens_padded`` keep as many columns as its fullest row).

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
    check_bshd(batch)
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
        for key in ENTRY_KEYS:
            if key in chunk:
                chunk[key] = chunk[key][:, :width]
        chunks.append(chunk)
    return chunks


def sequence_lengths(batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The validated real and padded lengths of a collated BSHD batch, sentinels dropped.

    Returns ``(seq_lens_S, seq_lens_padded_S)``: (S,) int64 each, row-major over the batch
    (row 0's sequences first). Raises ``ValueError`` as ``collate`` does.

    >>> sequence_lengths({"input_ids": torch.zeros(2, 4, dtype=torch.long),
    ...                   "labels": torch.zeros(2, 4, dtype=torch.long),
    ...                   "position_ids": torch.zeros(2, 4, dtype=torch.long),
    ...                   "seq_lens": torch.tensor([[1, 2], [3, -1000]]),
    ...                   "seq_lens_padded": torch.tensor([[2, 2], [4, -1000]])})
    (tensor([1, 2, 3]), tensor([2, 2, 4]))
    """
    check_bshd(batch)
    meta = bshd_meta(batch)
    return torch.tensor(meta.lengths, dtype=torch.int64), torch.tensor(meta.lengths_padded, dtype=torch.int64)


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
        if key in ENTRY_KEYS:
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
        if key in INT_TOKEN_KEYS:
            if stacked.dtype.is_floating_point or stacked.dtype.is_complex or stacked.dtype == torch.bool:
                raise TypeError(f"{key} must hold integers, got {stacked.dtype}")
            stacked = stacked.to(torch.int64)
        batch[key] = stacked
    entry_keys = [key for key in ENTRY_KEYS if key in packs[0]]
    lengths = {key: [_as_lengths(p[key], i, key) for i, p in enumerate(packs)] for key in entry_keys}
    counts_B = [len(padded) for padded in lengths["seq_lens_padded"]]
    for key in entry_keys:
        if any(row.ndim != 1 for row in lengths[key]) or [len(row) for row in lengths[key]] != counts_B:
            i = next(i for i, row in enumerate(lengths[key]) if row.ndim != 1 or len(row) != counts_B[i])
            raise ValueError(
                f"pack {i} has {key} {lengths[key][i].tolist()} and seq_lens_padded "
                f"{lengths['seq_lens_padded'][i].tolist()}; both must be 1-D with one entry per sequence"
            )
    # every key's (B, S) matrix in one masked assignment: the sentinel, then the packs' rows in order
    present_BS = np.arange(max(counts_B)) < np.array(counts_B)[:, None]
    for key in entry_keys:
        matrix_BS = np.full(present_BS.shape, SEQ_LENS_SENTINEL, dtype=np.int64)
        matrix_BS[present_BS] = np.concatenate(lengths[key])
        batch[key] = torch.from_numpy(matrix_BS)
    return batch


def _as_lengths(value: Any, pack_index: int, key: str) -> np.ndarray:
    """A pack's per-entry key (seq_lens, ...) as an int64 numpy array (metadata is tiny: numpy is cheapest)."""
    if isinstance(value, torch.Tensor):  # a plain CPU tensor converts without the detach / cpu calls
        plain = value.device.type == "cpu" and not value.requires_grad
        array = value.numpy() if plain else value.detach().cpu().numpy()
    else:
        array = np.asarray(value)
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"pack {pack_index} has {key} of dtype {array.dtype}; lengths must be integers")
    return array.astype(np.int64, copy=False)


def _as_tensor(value: Any, pack_index: int, key: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"pack {pack_index} has {key} of type {type(value).__name__}, not a tensor: {err}") from err


def _flatten(batch: Mapping[str, Any], meta: ThdMeta) -> THDBatch:
    """The THD batch of a checked BSHD batch; metadata computed on the host, moved to the batch's device.

    Every (B, L, ...) tensor becomes (T, ...), row-major; other values pass through.
    """
    B, L = batch["input_ids"].shape[:2]
    T = B * L
    device = batch["input_ids"].device

    def flat(value: Any) -> Any:
        return value.reshape(T, *value.shape[2:]) if isinstance(value, torch.Tensor) else value

    thd: THDBatch = {key: flat(batch[key]) for key in INT_TOKEN_KEYS}
    thd.update(
        cu_seqlens=cu_from_lengths(meta.lengths_S, device),
        cu_seqlens_padded=cu_from_lengths(meta.lengths_padded_S, device),
        max_seqlen=meta.max_seqlen,
        # TokenPlacement's rule for real rows (a prefix of each slot), without building the placement
        padding_mask=torch.from_numpy(~real_rows(meta.lengths_padded_S, meta.lengths_S)).to(device),
    )
    for key, value in batch.items():
        if key not in thd and key not in ENTRY_KEYS:
            thd[key] = flat(value)
    attach_meta(thd, meta)
    return thd


def _check_padding_labels(labels_T: torch.Tensor, padding_T: torch.Tensor, batch: Mapping[str, Any]) -> None:
    """``ValueError`` naming the pack (row of ``batch``) and position of the first label other than
    ``IGNORE_INDEX`` on a padding row (one vectorised pass)."""
    live_T = padding_T & (labels_T != IGNORE_INDEX)
    if not bool(live_T.any()):
        return
    L = batch["input_ids"].shape[1]
    t = int(torch.argmax(live_T.to(torch.uint8)))
    row = t // L
    lengths = {key: [n for n in batch[key][row].tolist() if n != SEQ_LENS_SENTINEL] for key in LENGTH_KEYS}
    raise ValueError(
        f"pack {row} has label {int(labels_T[t])} at position {t % L}, a padding row of its layout (seq_lens "
        f"{lengths['seq_lens']}, seq_lens_padded {lengths['seq_lens_padded']}); padding is labelled -100: fix "
        "seq_lens, or the labels"
    )
