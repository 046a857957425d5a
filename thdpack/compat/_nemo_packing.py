"""NeMo AutoModel drop-ins for building and collating packs (``pack_dataset``, the THD collater,
``create_block_causal_mask``), matching the current generation (v0.5 / main) output for output.

Legend: ``B`` rows (packs), ``L`` pack length, ``S`` sequences of a row.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from thdpack._optional import has_module
from thdpack.attention.masks import block_causal_mask
from thdpack.compat._nemo_errors import NemoRuntimeError
from thdpack.layout.rules import IGNORE_INDEX, check_pack_size
from thdpack.packing.packer import SampleTokens, assemble_pack, read_sample
from thdpack.plan import plan_packs
from thdpack.thd.batch import collate
from thdpack.thd.cu import cu_from_lengths
from thdpack.thd.format import PACK_KEYS, SEQ_LENS_SENTINEL  # NeMo's filler for "no sequence here"

log = logging.getLogger(__name__)

PAD_TOKEN_IDS_KEY = "___PAD_TOKEN_IDS___"
"""Item key through which NeMo datasets pass per-key pad ids to the collater."""


def _select_split(dataset: Any, split: str) -> Any:
    if isinstance(dataset, Mapping):  # a DatasetDict (or any dict of splits)
        if split not in dataset:
            raise ValueError(f"split {split!r} is not in the dataset; its splits are {sorted(dataset)}")
        return dataset[split]
    return dataset


def _read_for_nemo(sample: Mapping[str, Any], index: int) -> SampleTokens:
    loss_mask = sample.get("loss_mask") if isinstance(sample, Mapping) else None
    if loss_mask is not None and len(loss_mask) == 0:
        sample = {k: v for k, v in sample.items() if k != "loss_mask"}  # NeMo ignores an empty loss_mask
    # NeMo's pack_dataset packs labels as they come (its datasets and tests pass labels == input_ids)
    return read_sample(sample, index, labels_as_given=True)


def pack_dataset(
    dataset: Iterable[Mapping[str, Any]],
    split: str,
    packed_sequence_size: int,
    max_packs: int | None = None,
    padding_idx: int = 0,
    drop_long_samples: bool = True,
    cp_size: int = 1,
) -> Any:
    """NeMo AutoModel's ``pack_dataset``: order-preserving next-fit packs, identical to NeMo's.

    Built on ``plan_packs(..., algorithm="sequential")``. Differences, all on inputs NeMo
    mishandles: a missing split of a ``DatasetDict`` raises; samples are never modified (NeMo writes
    -100 into the caller's labels and pops ``loss_mask``); a sample without ``labels`` gets
    next-token labels; samples dropped by ``drop_long_samples=True`` are logged as a WARNING with
    their count and tokens.

    Args:
        dataset: samples (``input_ids``, optionally ``labels`` / ``loss_mask``), or a ``DatasetDict``.
        split: the split of a ``DatasetDict`` to pack.
        packed_sequence_size: tokens per pack; with ``cp_size > 1`` a multiple of ``2*cp_size``
            (else ``ValueError``: NeMo crashes or corrupts packs).
        max_packs: stop after this many packs (None: all).
        padding_idx: the pad token id.
        drop_long_samples: drop samples longer than a pack (else ``ValueError``).
        cp_size: the context-parallel size the packs are laid out for.

    Returns:
        A ``datasets.Dataset`` with columns ``input_ids, labels, position_ids, seq_lens,
        seq_lens_padded`` (lists of ints) when the ``datasets`` package is installed, else a list of
        dicts of the same lists.

    >>> rows = ([1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14])
    >>> base = [{"input_ids": ids, "labels": ids} for ids in rows]
    >>> packs = pack_dataset(base, "train", 10)
    >>> packs[0]["input_ids"], packs[0]["position_ids"]
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 0], [0, 1, 2, 0, 1, 2, 3, 0, 1, 2])
    >>> packs[0]["seq_lens"], packs[0]["seq_lens_padded"], packs[1]["seq_lens_padded"]
    ([3, 4, 2], [3, 4, 3], [10])
    """
    size = packed_sequence_size
    check_pack_size(size, cp_size)
    if max_packs is not None and max_packs < 1:
        raise ValueError(f"max_packs must be None or >= 1, got {max_packs}")
    dataset = _select_split(dataset, split)
    # next fit never looks back: the first max_packs packs hold at most max_packs * size samples,
    # and one more sample proves the last of them closed (long samples do not count: they are dropped)
    limit = None if max_packs is None else max_packs * size + 1
    read: list[SampleTokens] = []
    fitting = 0
    for index, sample in enumerate(dataset):
        read.append(_read_for_nemo(sample, index))
        fitting += len(read[-1]) <= size
        if limit is not None and fitting >= limit:
            break
    if not read:
        raise ValueError("No packs were produced: the dataset is empty")
    lengths = [len(t) for t in read]
    if drop_long_samples and all(n > size for n in lengths):
        raise ValueError(f"No packs were produced: all of its samples ({len(lengths)}) are longer than {size}")
    try:
        plan = plan_packs(
            lengths, size, algorithm="sequential", cp_size=cp_size, overflow="drop" if drop_long_samples else "error"
        )
    except ValueError as err:  # overflow="error": NeMo's words, thdpack's check
        first = next(i for i, n in enumerate(lengths) if n > size)
        raise ValueError(
            f"Dataset sample {first} is too long ({lengths[first]} > {size}). Please increase "
            "`packed_sequence_size`, or pass drop_long_samples=True to skip such samples."
        ) from err
    dropped = plan.stats.dropped_sequences
    if dropped:
        log.warning(
            "pack_dataset dropped %d samples longer than packed_sequence_size=%d (%d tokens); "
            "pass drop_long_samples=False to raise instead",
            dropped,
            size,
            plan.stats.dropped_tokens,
        )
    count = len(plan) if max_packs is None else min(max_packs, len(plan))
    columns: dict[str, list[list[int]]] = {key: [] for key in PACK_KEYS}
    for i in range(count):
        pack = assemble_pack([read[j] for j in plan[i]], size, cp_size=cp_size, pad_id=padding_idx)
        for key in PACK_KEYS:
            columns[key].append(pack[key].tolist())
    if has_module("datasets"):
        import datasets

        return datasets.Dataset.from_dict(columns)
    return [{key: columns[key][i] for key in PACK_KEYS} for i in range(count)]


def _single_sequence_pack(item: Mapping[str, Any], index: int, width: int, input_pad: int) -> dict[str, Any]:
    """A non-pack item as a one-sequence pack of ``width`` tokens (NeMo pads each to the batch's longest)."""
    if "labels" not in item:
        raise ValueError(f"item {index} has no 'labels' (keys: {sorted(item)})")
    ids = torch.as_tensor(item["input_ids"], dtype=torch.int64).reshape(-1)
    labels = torch.as_tensor(item["labels"], dtype=torch.int64).reshape(-1)
    if labels.shape != ids.shape:
        raise ValueError(
            f"item {index} has labels of shape {tuple(labels.shape)} but input_ids of shape {tuple(ids.shape)}; "
            "give one (already shifted) label per token"
        )
    real = len(ids)
    if item.get("attention_mask") is not None:
        start, real = _mask_span(item["attention_mask"], index, len(ids))
        if start:  # left padding: the real tokens move to the front, the masked ones become tail padding
            ids, labels = ids[start:], labels[start:]
    tail = width - len(ids)
    return {
        "input_ids": torch.cat([ids, ids.new_full((tail,), input_pad)]),
        "labels": torch.cat([labels, labels.new_full((tail,), IGNORE_INDEX)]),
        "position_ids": torch.arange(width),
        "seq_lens": [real],
        "seq_lens_padded": [width],
    }


def _mask_span(mask: Any, index: int, length: int) -> tuple[int, int]:
    """``(start, count)`` of the real tokens of item ``index``'s ``attention_mask``: ones in one run,
    at the end of the item (left padding) or at its start (right padding, all NeMo reads); any
    other mask is a ``ValueError`` naming the item.

    >>> _mask_span([0, 0, 1, 1, 1], 0, 5), _mask_span([1, 1, 0], 0, 3)
    ((2, 3), (0, 2))
    """
    values = torch.as_tensor(mask).reshape(-1).tolist()
    if len(values) != length or any(v not in (0, 1) for v in values):
        raise ValueError(
            f"item {index} has attention_mask {values} for {length} input_ids; give one 0 (padding) or 1 (token) "
            "per input id"
        )
    count = sum(values)
    start = values.index(1) if count else 0
    if values[start : start + count] != [1] * count or (start and start + count != length):
        raise ValueError(
            f"item {index} has attention_mask {values}: its tokens are not one run at the start or the end of the "
            "item (right or left padding), so they are not one sequence; collate each sequence as its own item, "
            "or pack them with pack_dataset"
        )
    return start, count


def packed_sequence_thd_collater(batch: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """NeMo AutoModel's ``packed_sequence_thd_collater``: ``thdpack.collate`` plus NeMo's names.

    Items without ``seq_lens`` are single sequences: each is padded to the longest (``input_ids``
    with the pad id of ``___PAD_TOKEN_IDS___['input_ids']`` or 0, ``labels`` with -100), real length
    = ``sum(attention_mask)`` or the length, then collated the same way. An ``attention_mask`` must
    mark one run of tokens at the start (right padding, NeMo's reading) or at the end of the item
    (left padding: NeMo would take the pad tokens for the sequence; thdpack moves the real tokens to
    the front and pads after them, labels -100); any other mask raises ``ValueError`` naming the
    item. Items are not modified.

    Args:
        batch: packs (items with ``seq_lens``) or single sequences, not both (``ValueError``).

    Returns:
        ``input_ids``, ``labels``, ``position_ids`` (B, L) int64, ``seq_lens`` and
        ``seq_lens_padded`` (B, S) int64 right-padded with -1000 (every width checked against
        ``input_ids``), and ``qkv_format="thd"``; ``{}`` for an empty batch. Packs of different
        lengths raise ``NemoRuntimeError``, a ``ValueError`` and the ``RuntimeError`` NeMo's
        ``torch.stack`` raises.

    >>> a = {"input_ids": [1, 2, 3, 0], "labels": [2, 3, -100, -100], "position_ids": [0, 1, 2, 3],
    ...      "seq_lens": [3], "seq_lens_padded": [4]}
    >>> b = {"input_ids": [4, 5, 6, 7], "labels": [5, -100, 7, -100], "position_ids": [0, 1, 0, 1],
    ...      "seq_lens": [2, 2], "seq_lens_padded": [2, 2]}
    >>> out = packed_sequence_thd_collater([a, b])
    >>> out["input_ids"].shape, out["seq_lens"].tolist(), out["seq_lens_padded"].tolist()
    (torch.Size([2, 4]), [[3, -1000], [2, 2]], [[4, -1000], [2, 2]])
    """
    if len(batch) == 0:
        return {}
    kinds = ["pack" if "seq_lens" in item else "sequence" for item in batch]
    if len(set(kinds)) > 1:
        other = kinds.index("sequence" if kinds[0] == "pack" else "pack")
        raise ValueError(
            f"item 0 is a {kinds[0]} but item {other} is a {kinds[other]}; a batch holds either packs (items with "
            "seq_lens, from pack_dataset) or single sequences, never both: collate them in separate batches"
        )
    if kinds[0] == "pack":
        widths = [len(item["input_ids"]) for item in batch]
        if len(set(widths)) > 1:
            raise NemoRuntimeError(f"packs must all have the same length (pack_size) to stack; got {widths}")
        packs = [{key: item[key] for key in PACK_KEYS if key in item} for item in batch]
    else:
        pad_ids = batch[0].get(PAD_TOKEN_IDS_KEY) or {}
        input_pad = 0 if pad_ids.get("input_ids") is None else pad_ids["input_ids"]
        width = max(len(item["input_ids"]) for item in batch)
        packs = [_single_sequence_pack(item, i, width, input_pad) for i, item in enumerate(batch)]
    return {**collate(packs), "qkv_format": "thd"}


def create_block_causal_mask(seq_lens: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """NeMo's block-causal mask: True where query i may attend to key j.

    Args:
        seq_lens: ``seq_lens[b]`` lists row b's sequence lengths; pass ``seq_lens_padded`` (sums to
            the pack size), not ``seq_lens``. Entries equal to -1000 (the collater's filler) are
            ignored; rows that sum to different lengths raise ``ValueError``.

    Returns:
        (B, 1, L, L) bool.

    >>> create_block_causal_mask([torch.tensor([2, 1])]).int()[0, 0].tolist()
    [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """
    rows = []
    for b, row in enumerate(seq_lens):
        lengths = torch.as_tensor(row, dtype=torch.int64).reshape(-1)
        lengths = lengths[lengths != SEQ_LENS_SENTINEL]
        if bool((lengths < 0).any()):
            raise ValueError(f"row {b} has negative sequence lengths {lengths.tolist()}")
        rows.append(lengths)
    if not rows:
        raise ValueError("seq_lens is empty: give one row of lengths per pack")
    totals = [int(r.sum()) for r in rows]
    if len(set(totals)) > 1:
        raise ValueError(
            f"rows sum to different lengths {totals}; every row must cover the same pack size "
            "(pass seq_lens_padded, which sums to the pack size, not seq_lens)"
        )
    masks = []
    for lengths in rows:  # each row as a THD batch without padding: thdpack's one mask rule
        cu = cu_from_lengths(lengths.numpy())
        masks.append(block_causal_mask({"cu_seqlens": cu, "cu_seqlens_padded": cu}))
    return torch.stack(masks)[:, None]


packed_block_causal_mask = create_block_causal_mask
"""NeMo's alias of ``create_block_causal_mask``."""
