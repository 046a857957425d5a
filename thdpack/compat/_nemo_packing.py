"""NeMo AutoModel drop-ins for building and collating packs (``pack_dataset``, the THD collater,
``create_block_causal_mask``), matching the current generation (v0.5 / main) output for output.

Legend: ``B`` rows (packs), ``S`` pack length, ``N`` sequences of a row.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from thdpack._optional import has_module
from thdpack.packing import layout
from thdpack.packing.packer import SampleTokens, assemble_pack, read_sample
from thdpack.plan import plan_packs
from thdpack.thd.format import SEQ_LENS_SENTINEL  # NeMo's filler for "no sequence here"

log = logging.getLogger(__name__)

PAD_TOKEN_IDS_KEY = "___PAD_TOKEN_IDS___"
"""Item key through which NeMo datasets pass per-key pad ids to the collater."""
PACK_KEYS = ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded")


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
    return read_sample(sample, index)


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
    mishandles: ``packed_sequence_size % (2*cp_size) != 0`` with ``cp_size > 1`` raises
    ``ValueError`` (NeMo crashes or corrupts packs); a missing split of a ``DatasetDict`` raises;
    samples are never modified (NeMo writes -100 into the caller's labels and pops
    ``loss_mask``); a sample without ``labels`` gets next-token labels; samples dropped by
    ``drop_long_samples=True`` are logged as a WARNING with their count and tokens.

    Returns a ``datasets.Dataset`` with columns ``input_ids, labels, position_ids, seq_lens,
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
    layout.check_pack_size(size, cp_size)
    if max_packs is not None and max_packs < 1:
        raise ValueError(f"max_packs must be None or >= 1, got {max_packs}")
    dataset = _select_split(dataset, split)
    # next fit never looks back: the first max_packs packs hold at most max_packs * size samples,
    # and one more sample proves the last of them closed
    limit = None if max_packs is None else max_packs * size + 1
    kept: list[SampleTokens] = []
    dropped, dropped_tokens = 0, 0
    for index, sample in enumerate(dataset):
        tokens = _read_for_nemo(sample, index)
        if len(tokens) > size:
            if not drop_long_samples:
                raise ValueError(
                    f"Dataset sample {index} is too long ({len(tokens)} > {size}). Please increase "
                    "`packed_sequence_size`, or pass drop_long_samples=True to skip such samples."
                )
            dropped += 1
            dropped_tokens += len(tokens)
            continue
        kept.append(tokens)
        if limit is not None and len(kept) >= limit:
            break
    if dropped:
        log.warning(
            "pack_dataset dropped %d samples longer than packed_sequence_size=%d (%d tokens); "
            "pass drop_long_samples=False to raise instead",
            dropped,
            size,
            dropped_tokens,
        )
    if not kept:
        raise ValueError(
            "No packs were produced: the dataset is empty"
            + (f" or all of its samples ({dropped}) are longer than {size}" if dropped else "")
        )
    plan = plan_packs([len(t) for t in kept], size, algorithm="sequential", cp_size=cp_size)
    count = len(plan) if max_packs is None else min(max_packs, len(plan))
    columns: dict[str, list[list[int]]] = {key: [] for key in PACK_KEYS}
    for i in range(count):
        pack = assemble_pack([kept[j] for j in plan[i]], size, cp_size=cp_size, pad_id=padding_idx)
        for key in PACK_KEYS:
            columns[key].append(pack[key].tolist())
    if has_module("datasets"):
        import datasets

        return datasets.Dataset.from_dict(columns)
    return [{key: columns[key][i] for key in PACK_KEYS} for i in range(count)]


def _pad_rows(rows: Sequence[Sequence[int]], value: int) -> torch.Tensor:
    """Right-pad integer rows to the longest with ``value``: (B, max_len) int64."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=torch.int64)
    for b, row in enumerate(rows):
        out[b, : len(row)] = torch.as_tensor(row, dtype=torch.int64)
    return out


def packed_sequence_thd_collater(batch: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """NeMo AutoModel's ``packed_sequence_thd_collater``: stack packs into a BSHD batch.

    Packs (items with ``seq_lens``) are stacked: ``input_ids``, ``labels``, ``position_ids``
    become (B, S) int64; ``seq_lens`` and ``seq_lens_padded`` (B, max N) int64 right-padded
    with -1000. Items without ``seq_lens`` are single sequences: each is padded to the longest
    (``input_ids`` with the pad id of ``___PAD_TOKEN_IDS___['input_ids']`` or 0, ``labels`` with
    -100), real length = ``sum(attention_mask)`` or the length. Returns those five keys plus
    ``qkv_format="thd"``; ``{}`` for an empty batch. Items are not modified. Packs of different
    lengths raise ``ValueError``.

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
    pad_ids = batch[0].get(PAD_TOKEN_IDS_KEY) or {}
    if "seq_lens" in batch[0]:
        input_ids = [item["input_ids"] for item in batch]
        labels = [item["labels"] for item in batch]
        position_ids = [item["position_ids"] for item in batch]
        seq_lens = [torch.as_tensor(item["seq_lens"]).tolist() for item in batch]
        seq_lens_padded = [torch.as_tensor(item["seq_lens_padded"]).tolist() for item in batch]
        widths = [len(x) for x in input_ids]
        if len(set(widths)) > 1:
            raise ValueError(f"packs must all have the same length (pack_size) to stack; got {widths}")
    else:
        input_pad = pad_ids.get("input_ids")
        input_pad = 0 if input_pad is None else input_pad
        width = max(len(item["input_ids"]) for item in batch)
        input_ids, labels, position_ids, seq_lens, seq_lens_padded = [], [], [], [], []
        for i, item in enumerate(batch):
            if "labels" not in item:
                raise ValueError(f"item {i} has no 'labels' (keys: {sorted(item)})")
            ids = torch.as_tensor(item["input_ids"]).tolist()
            mask = item.get("attention_mask")
            seq_lens.append([int(torch.as_tensor(mask).sum()) if mask is not None else len(ids)])
            seq_lens_padded.append([width])
            input_ids.append(ids + [input_pad] * (width - len(ids)))
            lab = torch.as_tensor(item["labels"]).tolist()
            labels.append(lab + [layout.IGNORE_INDEX] * (width - len(lab)))
            position_ids.append(list(range(width)))
    return {
        "input_ids": torch.stack([torch.as_tensor(x, dtype=torch.int64) for x in input_ids]),
        "labels": torch.stack([torch.as_tensor(x, dtype=torch.int64) for x in labels]),
        "position_ids": torch.stack([torch.as_tensor(x, dtype=torch.int64) for x in position_ids]),
        "seq_lens": _pad_rows(seq_lens, SEQ_LENS_SENTINEL),
        "seq_lens_padded": _pad_rows(seq_lens_padded, SEQ_LENS_SENTINEL),
        "qkv_format": "thd",
    }


def create_block_causal_mask(seq_lens: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """NeMo's block-causal mask: (B, 1, S, S) bool, True where query i may attend to key j.

    ``seq_lens[b]`` lists row b's sequence lengths; pass ``seq_lens_padded`` (sums to the pack
    size), not ``seq_lens``. Entries equal to -1000 (the collater's filler) are ignored; rows
    that sum to different lengths raise ``ValueError``.

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
    total = totals[0]
    causal_SS = torch.ones(total, total, dtype=torch.bool).tril()
    masks = []
    for lengths in rows:
        doc_S = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        masks.append((doc_S[:, None] == doc_S[None, :]) & causal_SS)
    return torch.stack(masks)[:, None]


packed_block_causal_mask = create_block_causal_mask
"""NeMo's alias of ``create_block_causal_mask``."""
