"""Shared checks for packs: layout invariants, token conservation, labels that stay in their document.

Samples made by ``unique_samples`` carry globally unique token ids, so every real token of a
pack tells which sample and offset it came from.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from thdpack.layout.rules import IGNORE_INDEX, cp_multiple, round_up_to_cp
from thdpack.packing.pack_layout import position_ids
from thdpack.thd.tokens import real_rows

N = IGNORE_INDEX


def unique_samples(lengths, rng: np.random.Generator, *, labels: bool, loss_mask: bool) -> list[dict]:
    """Samples whose token ids 1, 2, 3, ... never repeat; optional shifted labels and loss masks."""
    samples, next_id = [], 1
    for n in lengths:
        ids = list(range(next_id, next_id + n))
        next_id += n
        sample = {"input_ids": ids}
        if labels:  # already shifted targets, with some prompt-like -100s
            sample["labels"] = [N if rng.random() < 0.2 else x + 1 for x in ids]
        if loss_mask:
            sample["loss_mask"] = rng.integers(0, 2, n).tolist()
        samples.append(sample)
    return samples


def expected_labels(sample: dict) -> list[int]:
    """The labels the loss must see for every token of ``sample``."""
    ids = sample["input_ids"]
    out = list(sample["labels"]) if "labels" in sample else [*ids[1:], N]
    if "loss_mask" in sample:
        out = [N if m == 0 else x for x, m in zip(out, sample["loss_mask"], strict=True)]
    return out


def check_pack(pack, samples, pack_size: int, cp_size: int, pad_id: int) -> Counter:
    """Assert every layout invariant of one pack; return the (sample, offset) of its real tokens."""
    for key in ("input_ids", "labels", "position_ids"):
        assert pack[key].shape == (pack_size,) and pack[key].dtype == torch.int64, key
    seq_lens, padded = pack["seq_lens"].numpy(), pack["seq_lens_padded"].numpy()
    assert pack["seq_lens"].dtype == torch.int64 and pack["seq_lens_padded"].dtype == torch.int64
    assert len(seq_lens) == len(padded) >= 1 and (seq_lens >= 1).all() and (padded >= seq_lens).all()
    assert padded.sum() == pack_size
    multiple = cp_multiple(cp_size)
    assert (padded % multiple == 0).all()
    assert (padded[:-1] == round_up_to_cp(seq_lens[:-1], cp_size)).all()  # tail padding only at the end
    assert pack["position_ids"].tolist() == position_ids(padded).tolist()  # restart per sequence
    pad = ~real_rows(padded, seq_lens)
    assert (pack["input_ids"].numpy()[pad] == pad_id).all() and (pack["labels"].numpy()[pad] == N).all()
    starts = np.cumsum(np.concatenate(([0], samples_lengths(samples))))
    ids, labels = pack["input_ids"].numpy()[~pad], pack["labels"].numpy()[~pad]
    seen: Counter = Counter()
    for piece_ids, piece_labels in zip(
        np.split(ids, np.cumsum(seq_lens)[:-1]), np.split(labels, np.cumsum(seq_lens)[:-1]), strict=True
    ):
        sample = int(np.searchsorted(starts, piece_ids[0] - 1, side="right")) - 1
        offsets = piece_ids - starts[sample] - 1
        assert (np.diff(offsets) == 1).all(), "a piece is consecutive tokens of one sample"
        assert offsets[0] >= 0 and offsets[-1] < len(samples[sample]["input_ids"])
        want = np.array(expected_labels(samples[sample]))[offsets]
        assert piece_labels.tolist() == want.tolist(), "labels are the sample's own (never the next sample's)"
        seen.update((sample, int(o)) for o in offsets)
    return seen


def samples_lengths(samples) -> list[int]:
    return [len(s["input_ids"]) for s in samples]


def expected_tokens(samples, pack_size: int, overflow: str) -> Counter:
    """(sample, offset) of every token the packs must hold exactly once under ``overflow``."""
    out: Counter = Counter()
    for i, n in enumerate(samples_lengths(samples)):
        if n > pack_size and overflow == "drop":
            continue
        keep = min(n, pack_size) if overflow == "truncate" else n
        out.update((i, o) for o in range(keep))
    return out


def check_packs(packs, samples, pack_size: int, cp_size: int, pad_id: int, overflow: str) -> None:
    """Every pack is well formed and the packs hold each expected token exactly once."""
    seen: Counter = Counter()
    for pack in packs:
        seen.update(check_pack(pack, samples, pack_size, cp_size, pad_id))
    assert seen == expected_tokens(samples, pack_size, overflow)
