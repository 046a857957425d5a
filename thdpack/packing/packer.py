"""Packs from tokenized samples: NeMo AutoModel's pack format, built one pack at a time.

A sample has ``input_ids`` and optionally ``labels`` (already shifted: ``labels[t]`` is the
target of ``input_ids[t]``) or ``loss_mask``; without labels they are derived inside each
sequence. A pack (``Pack``) holds ``input_ids``, ``labels``, ``position_ids`` of ``pack_size``
tokens, ``seq_lens`` and ``seq_lens_padded`` (``pack_layout``), and a placed plan's group keys.
Bad samples are refused naming the sample and the position (a negative token id, a label that is
no token id, a ``loss_mask`` other than 0 / 1, an ``attention_mask`` with a 0, labels equal to
``input_ids``, which would train a copy task), by a few vectorised checks per sample. A split
sequence's piece keeps the label of the token after it, so no target is lost.

Legend: ``T`` tokens of a pack (``pack_size``), ``S`` sequences in the pack.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np
import torch

from thdpack.layout.placement import PackPlacement
from thdpack.layout.rules import IGNORE_INDEX
from thdpack.packing.pack_layout import (
    apply_loss_mask,
    next_token_labels,
    pack_seq_lens_padded,
    placed_seq_lens_padded,
    position_ids,
)
from thdpack.plan.packplan import PackPlan


class _PlacedKeys(TypedDict, total=False):
    """The keys a pack of a per-sequence CP placement adds (one per entry, padding entries included)."""

    cp_group_size: torch.Tensor
    """(S,) ranks of each entry's group: 1 = whole on one rank, g > 1 = split over g ranks."""
    cp_group_start: torch.Tensor
    """(S,) first rank of each entry's group."""
    cp_a2a: torch.Tensor
    """(S,) 1 on every entry when the pack is attended by all-to-all, else 0 (``cp_placement="auto"``)."""


class Pack(_PlacedKeys):
    """One pack in NeMo AutoModel's format; every tensor int64."""

    input_ids: torch.Tensor
    """(T,) token ids; padding carries the pad id."""
    labels: torch.Tensor
    """(T,) targets; -100 on padding and wherever nothing is predicted."""
    position_ids: torch.Tensor
    """(T,) restart at 0 per sequence, run on through its padding."""
    seq_lens: torch.Tensor
    """(S,) real lengths, in placement order."""
    seq_lens_padded: torch.Tensor
    """(S,) CP-rounded lengths, tail padding added to the last (a CP placement: in one padding entry
    per rank); sums to T."""


@dataclass(frozen=True)
class SampleTokens:
    """A validated sample: int64 ids and the labels the loss will see.

    The arrays may share memory with the caller's sample; nothing in thdpack writes to them.
    """

    input_ids: np.ndarray
    """(L,) int64, L >= 1."""
    labels: np.ndarray
    """(L,) int64; -100 where nothing is predicted."""

    def __len__(self) -> int:
        return len(self.input_ids)

    def piece(self, start: int, length: int) -> SampleTokens:
        """Tokens ``[start, start + length)`` with their labels."""
        return SampleTokens(self.input_ids[start : start + length], self.labels[start : start + length])


def _int_array(value: Any, index: int, key: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.ndim != 1:
        raise ValueError(f"sample {index}: {key} must be 1-D, got shape {array.shape}")
    if array.size == 0:  # an empty list reads as float64; its length is what gets reported
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind not in "iu":
        shown = array[:5].tolist()
        raise TypeError(f"sample {index}: {key} must hold integers, got dtype {array.dtype} (first values {shown})")
    return array.astype(np.int64, copy=False)


def read_sample(
    sample: Mapping[str, Any], index: int, *, vocab_size: int | None = None, labels_as_given: bool = False
) -> SampleTokens:
    """Validate ``sample`` and return its ids and labels (new arrays; ``sample`` is untouched).

    Raises ``TypeError`` / ``ValueError`` naming ``index`` and the offending values: missing or
    empty ``input_ids``, non-integer ids or labels, ``labels`` / ``loss_mask`` of another length, and
    what the module docstring lists (a negative id, or one ``>= vocab_size`` when given; unshifted
    labels, unless ``labels_as_given``; a ``loss_mask`` value other than 0 / 1; padding in
    ``attention_mask``).

    >>> s = read_sample({"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, 0)
    >>> s.labels.tolist()         # derived next-token labels, prompt token masked
    [-100, 7, -100]
    >>> read_sample({"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, 3)
    Traceback (most recent call last):
    ...
    ValueError: sample 3: labels equal input_ids at every labelled position (3 of them, e.g. position 0: 5); ...
    """
    if not isinstance(sample, Mapping):
        raise TypeError(f"sample {index} must be a mapping with 'input_ids', got {type(sample).__name__}")
    if "input_ids" not in sample:
        raise ValueError(f"sample {index} has no 'input_ids' (keys: {sorted(sample)})")
    input_ids = _int_array(sample["input_ids"], index, "input_ids")
    if len(input_ids) == 0:
        raise ValueError(f"sample {index} has empty input_ids; filter empty samples out before packing")
    check_token_ids(input_ids, f"sample {index}", "input_ids", vocab_size=vocab_size)
    _check_attention_mask(sample.get("attention_mask"), index, len(input_ids))
    labels = sample.get("labels")
    if labels is None:
        labels = next_token_labels(input_ids)
    else:
        labels = _int_array(labels, index, "labels")
        if len(labels) != len(input_ids):
            raise ValueError(
                f"sample {index}: labels has {len(labels)} tokens but input_ids has {len(input_ids)}; "
                "labels[t] must be the (already shifted) target of input_ids[t]"
            )
        check_token_ids(labels, f"sample {index}", "labels", vocab_size=vocab_size, ignored=IGNORE_INDEX)
        if not labels_as_given:
            _check_shifted(input_ids, labels, index)
    loss_mask = sample.get("loss_mask")
    if loss_mask is not None:
        if isinstance(loss_mask, torch.Tensor):
            loss_mask = loss_mask.detach().cpu().numpy()
        loss_mask = np.asarray(loss_mask)
        if loss_mask.dtype.kind not in "iub":
            raise TypeError(f"sample {index}: loss_mask must hold 0/1 or booleans, got dtype {loss_mask.dtype}")
        if loss_mask.shape != input_ids.shape:
            raise ValueError(
                f"sample {index}: loss_mask has {loss_mask.size} entries but input_ids has "
                f"{len(input_ids)}; give one 0/1 per token"
            )
        if loss_mask.dtype.kind != "b" and (loss_mask.min() < 0 or loss_mask.max() > 1):
            t = int(np.argmax((loss_mask < 0) | (loss_mask > 1)))
            raise ValueError(
                f"sample {index}: loss_mask is {int(loss_mask[t])} at position {t}; give 1 (train on the token's "
                "label) or 0 (no loss) per token (per-token weights are not a loss mask: see "
                "thdpack.loss.loss_weights)"
            )
        labels = apply_loss_mask(labels, loss_mask)
    return SampleTokens(input_ids, labels)


def check_token_ids(
    values: np.ndarray, owner: str, key: str, *, vocab_size: int | None = None, ignored: int | None = None
) -> None:
    """``ValueError`` naming ``owner`` ("sample 3"), ``key`` and the first position of a value that is
    no token id: negative, or ``>= vocab_size`` when given; ``ignored`` (labels' -100) is allowed.

    The position is looked for only on failure.

    >>> check_token_ids(np.array([4, -100, 7]), "sample 3", "labels", vocab_size=8, ignored=-100)
    >>> check_token_ids(np.array([4, 9, 7]), "example 0", "input_ids", vocab_size=8)
    Traceback (most recent call last):
    ...
    ValueError: example 0: input_ids holds 9 at position 1, not a token id of the vocabulary of 8 (ids 0..7); ...
    """
    # one or two reductions when every value is valid (the vocabulary's bound only when known)
    if ignored is None:
        too_low = values.min() < 0
    else:  # below 0 only ``ignored``: counted, not masked, so no temporary index arrays
        too_low = np.count_nonzero(values < 0) != np.count_nonzero(values == ignored)
    too_high = vocab_size is not None and values.max() >= vocab_size
    if not (too_low or too_high):
        return
    bad = values < 0 if ignored is None else (values < 0) & (values != ignored)
    if too_high:
        bad |= values >= vocab_size
    t = int(np.argmax(bad))
    allowed = f" or {ignored} (no loss)" if ignored is not None else ""
    if vocab_size is None:
        raise ValueError(
            f"{owner}: {key} holds {int(values[t])} at position {t}; token ids are >= 0{allowed}: check the "
            "tokenization"
        )
    raise ValueError(
        f"{owner}: {key} holds {int(values[t])} at position {t}, not a token id of the vocabulary of {vocab_size} "
        f"(ids 0..{vocab_size - 1}{allowed}); tokenize with the model's tokenizer, or give the model a larger "
        "vocabulary"
    )


def _check_shifted(input_ids: np.ndarray, labels: np.ndarray, index: int) -> None:
    """``ValueError`` when ``labels`` equal ``input_ids`` at every labelled position while shifted labels
    (``labels[t] == input_ids[t+1]``) they are not: Hugging Face's aligned labels."""
    # two counting passes decide the usual case (shifted labels differ from input_ids somewhere)
    labelled = len(labels) - np.count_nonzero(labels == IGNORE_INDEX)
    if labelled == 0 or np.count_nonzero(labels == input_ids) != labelled:  # ids >= 0: never equal to -100
        return
    live = labels != IGNORE_INDEX
    inside = live[:-1]  # a shifted last label points past the sample: no evidence either way
    if np.array_equal(labels[:-1][inside], input_ids[1:][inside]):
        return  # one token repeated: shifted and aligned alike
    t = int(np.argmax(live))
    raise ValueError(
        f"sample {index}: labels equal input_ids at every labelled position ({labelled} of them, e.g. "
        f"position {t}: {int(labels[t])}); thdpack's labels are already shifted (labels[t] is the token after "
        "input_ids[t]), as packed here they would train a copy task. Hugging Face labels: pass "
        "np.append(labels[1:], -100), or drop labels (next-token labels are derived; loss_mask masks a prompt)"
    )


def _check_attention_mask(mask: Any, index: int, length: int) -> None:
    """``ValueError`` unless ``mask`` is None or all ones (``length`` of them): packs hold unpadded samples."""
    if mask is None:
        return
    if isinstance(mask, torch.Tensor):
        mask = mask.detach().cpu().numpy()
    mask = np.asarray(mask)
    if mask.shape != (length,):
        raise ValueError(
            f"sample {index}: attention_mask has shape {mask.shape} but input_ids has {length} tokens; give one 1 "
            "per token, or no attention_mask"
        )
    padding = mask != 1
    if padding.any():
        where = np.flatnonzero(padding)
        shown = ", ".join(str(t) for t in where[:5]) + (" ..." if len(where) > 5 else "")
        raise ValueError(
            f"sample {index}: attention_mask is not 1 at {len(where)} of {length} positions ({shown}): padding, "
            "which packing would train as text (packs need no padding); pass input_ids[attention_mask == 1] "
            "(and its labels), or tokenize without padding"
        )


def check_pad_id(pad_id: object) -> int:
    """``pad_id`` as an ``int``; ``TypeError`` unless it is an integer token id."""
    if isinstance(pad_id, bool) or not isinstance(pad_id, (int, np.integer)):
        raise TypeError(f"pad_id must be an integer token id, got {pad_id!r}")
    return int(pad_id)


def assemble_pack(
    pieces: Sequence[SampleTokens],
    pack_size: int,
    *,
    cp_size: int = 1,
    pad_id: int = 0,
    placement: PackPlacement | None = None,
) -> Pack:
    """Lay ``pieces`` out back to back in a pack of ``pack_size`` tokens.

    Each piece starts at a multiple of ``2*cp_size`` (CP padding after each piece; tail padding
    at the end). Padding gets ``pad_id`` and label -100. Raises ``ValueError`` when the pieces
    do not fit. With a ``placement`` (of ``pack_size`` tokens and ``cp_size`` ranks) the pieces are
    laid out by it instead (``layout.placed_seq_lens_padded``: split pieces padded to ``2g``,
    whole ones not, one padding entry per rank) and the pack carries ``cp_group_size`` /
    ``cp_group_start``.

    >>> a = SampleTokens(np.array([1, 2, 3]), np.array([2, 3, -100]))
    >>> b = SampleTokens(np.array([4, 5]), np.array([5, -100]))
    >>> pack = assemble_pack([a, b], 8, cp_size=2, pad_id=0)
    >>> pack["input_ids"].tolist(), pack["labels"].tolist()
    ([1, 2, 3, 0, 4, 5, 0, 0], [2, 3, -100, -100, 5, -100, -100, -100])
    >>> pack["position_ids"].tolist(), pack["seq_lens"].tolist(), pack["seq_lens_padded"].tolist()
    ([0, 1, 2, 3, 0, 1, 2, 3], [3, 2], [4, 4])
    """
    check_pad_id(pad_id)
    seq_lens = np.array([len(p) for p in pieces], dtype=np.int64)
    placed = None
    if placement is None:
        seq_lens_padded = pack_seq_lens_padded(seq_lens, pack_size, cp_size)
    else:
        if (placement.pack_size, placement.cp_size) != (pack_size, cp_size):
            raise ValueError(
                f"the CP placement is for packs of {placement.pack_size} tokens over cp_size={placement.cp_size}, "
                f"not pack_size={pack_size}, cp_size={cp_size}; pass the plan's pack and CP sizes"
            )
        placed = placed_seq_lens_padded(seq_lens, placement)
        seq_lens, seq_lens_padded = placed.lengths_S, placed.slots_S
    # destination of every real token: its piece's slot start plus its offset in the piece
    slot_starts = np.cumsum(seq_lens_padded) - seq_lens_padded
    real_starts = np.cumsum(seq_lens) - seq_lens
    dest_T = np.arange(int(seq_lens.sum()), dtype=np.int64) + np.repeat(slot_starts - real_starts, seq_lens)
    input_ids_T = np.full(pack_size, pad_id, dtype=np.int64)
    labels_T = np.full(pack_size, IGNORE_INDEX, dtype=np.int64)
    input_ids_T[dest_T] = np.concatenate([p.input_ids for p in pieces])
    labels_T[dest_T] = np.concatenate([p.labels for p in pieces])
    pack = Pack(
        input_ids=torch.from_numpy(input_ids_T),
        labels=torch.from_numpy(labels_T),
        position_ids=torch.from_numpy(position_ids(seq_lens_padded)),
        seq_lens=torch.from_numpy(seq_lens),
        seq_lens_padded=torch.from_numpy(seq_lens_padded),
    )
    if placed is not None:
        pack["cp_group_size"] = torch.from_numpy(placed.group_size_S)
        pack["cp_group_start"] = torch.from_numpy(placed.group_start_S)
    return pack


def build_pack(samples: Sequence[Mapping[str, Any]], plan: PackPlan, index: int, *, pad_id: int = 0) -> Pack:
    """Pack ``index`` of ``plan`` from ``samples`` (its pack size and CP size are the plan's).

    Args:
        samples: the samples the plan was made for (``input_ids``, optionally ``labels`` or
            ``loss_mask``), indexable by the plan's sequence ids.
        plan: the ``PackPlan``.
        index: which pack, ``0 <= index < len(plan)``.
        pad_id: the token id of padding.

    Returns:
        The ``Pack``: ``input_ids``, ``labels``, ``position_ids`` (``pack_size``,) int64,
        ``seq_lens``, ``seq_lens_padded``, and a placed plan's group keys.

    Raises ``ValueError`` naming the sample when a sample's length is not the one the plan was
    made for.

    >>> from thdpack.plan import plan_packs
    >>> samples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6, 7, 8], "labels": [5, 6, 7, 8, 9]}]
    >>> plan = plan_packs([3, 5], 12, cp_size=2)
    >>> pack = build_pack(samples, plan, 0)
    >>> pack["input_ids"].tolist()
    [4, 5, 6, 7, 8, 0, 0, 0, 1, 2, 3, 0]
    >>> pack["labels"].tolist()
    [5, 6, 7, 8, 9, -100, -100, -100, 2, 3, -100, -100]
    >>> pack["position_ids"].tolist(), pack["seq_lens"].tolist(), pack["seq_lens_padded"].tolist()
    ([0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3], [5, 3], [8, 4])
    """
    pack = pack_from_segments(
        samples,
        plan.segments(index),
        plan.pack_size,
        cp_size=plan.cp_size,
        pad_id=pad_id,
        sample_lengths=plan.sequence_lengths,
        placement=None if plan.placement is None else plan.placement.pack(index),
    )
    if plan.a2a_packs is not None:  # cp_placement="auto": how the attention runs this pack
        pack["cp_a2a"] = torch.full_like(pack["cp_group_size"], int(plan.a2a_packs[index]))
    return pack


def pack_from_segments(
    samples: Sequence[Mapping[str, Any]],
    segments: tuple[Sequence[int], Sequence[int], Sequence[int]],
    pack_size: int,
    *,
    cp_size: int = 1,
    pad_id: int = 0,
    sample_lengths: np.ndarray | None = None,
    placement: PackPlacement | None = None,
) -> Pack:
    """One pack of ``pack_size`` tokens from ``samples`` and ``segments`` ``(indices, starts, lengths)``
    laid out by hand (``build_pack`` takes them from a plan).

    Entry ``j`` takes tokens ``[starts[j], starts[j] + lengths[j])`` of ``samples[indices[j]]``;
    ``placement``: the pack's CP placement (``assemble_pack``).
    Raises ``ValueError`` naming the sample when an entry reaches past the sample's end, or when
    ``sample_lengths`` (the lengths the segments were planned for) disagree with the sample.

    >>> samples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6, 7, 8]}]
    >>> pack = pack_from_segments(samples, ([1, 0], [0, 0], [5, 3]), 12, cp_size=2)
    >>> pack["seq_lens"].tolist(), pack["seq_lens_padded"].tolist()
    ([5, 3], [8, 4])

    A piece of a split sequence keeps the label of the token after it:

    >>> pack = pack_from_segments([{"input_ids": [1, 2, 3, 4, 5, 6]}], ([0], [0], [4]), 4)
    >>> pack["input_ids"].tolist(), pack["labels"].tolist()
    ([1, 2, 3, 4], [2, 3, 4, 5])
    """
    indices, starts, lengths = (np.asarray(a, dtype=np.int64) for a in segments)
    if not len(indices) == len(starts) == len(lengths):
        raise ValueError(
            f"segments must have equal lengths, got {len(indices)} indices, {len(starts)} starts, "
            f"{len(lengths)} lengths"
        )
    pieces = []
    for index, start, length in zip(indices.tolist(), starts.tolist(), lengths.tolist(), strict=True):
        tokens = read_sample(samples[index], index)
        if sample_lengths is not None and len(tokens) != sample_lengths[index]:
            raise ValueError(
                f"sample {index} has {len(tokens)} tokens but the plan was made for length "
                f"{int(sample_lengths[index])}; pass lengths that match the samples"
            )
        if start < 0 or length < 1 or start + length > len(tokens):
            raise ValueError(
                f"sample {index} has {len(tokens)} tokens but the plan takes tokens [{start}, "
                f"{start + length}); the plan was made for other lengths (pass the samples' lengths)"
            )
        pieces.append(tokens if start == 0 and length == len(tokens) else tokens.piece(start, length))
    return assemble_pack(pieces, pack_size, cp_size=cp_size, pad_id=pad_id, placement=placement)
