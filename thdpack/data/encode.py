"""Tokenization: the shipped GPT-2 tokenizer or any Hugging Face tokenizer, batched, with SFT masks.

A record becomes a ``TokenizedSample``: the token row (EOS appended after each document and SFT
response; a chat template's own end-of-turn tokens end its turns) and a target mask (True where a
token is trained). Chats are rendered with the tokenizer's chat template when it has one, and
their targets are the tokens whose character offsets overlap an assistant turn. Models see a
sample in one of two equivalent formats (``SampleFormat``): ``"labels"`` (NeMo's:
``input_ids = tokens[:-1]``, ``labels = tokens[1:]`` with -100 off target, already shifted) or
``"loss_mask"`` (``input_ids = tokens`` and a 0 / 1 mask; the packer derives the labels).

>>> tok = load_tokenizer("gpt2")
>>> tok.encode_batch(["Hello world"])
[[15496, 995]]
>>> sample = SampleEncoder(tok).encode([{"text": "Hello world"}])[0]
>>> sample.tokens.tolist(), sample.as_labels()["labels"].tolist()
([15496, 995, 50256], [995, 50256])
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, get_args

import numpy as np

from thdpack.data._progress import progress_bar
from thdpack.data.bad_records import ON_BAD_RECORD, BadRecord, BadRecords, OnBadRecord
from thdpack.data.chat_template import RenderedChat
from thdpack.data.records import (
    RECORD_KINDS,
    RecordKind,
    Segment,
    chat_messages,
    check_kind,
    detect_kind,
    record_segments,
    text_chars,
)
from thdpack.data.tokenizer import EOS_CANDIDATES, TextTokenizer, load_tokenizer
from thdpack.layout.rules import IGNORE_INDEX

SampleFormat = Literal["labels", "loss_mask"]
SAMPLE_FORMATS: tuple[str, ...] = get_args(SampleFormat)
ChatTemplateChoice = Literal["auto", "tokenizer", "plain"]
CHAT_TEMPLATE_CHOICES: tuple[str, ...] = get_args(ChatTemplateChoice)
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class TokenizeConfig:
    """How records become token ids."""

    kind: RecordKind | Literal["auto"] = "auto"
    """Record kind (``thdpack.data.records``); ``"auto"`` tells it from each record's keys."""
    text_key: str = "text"
    """Field holding a document's text (``text`` records)."""
    append_eos: bool = True
    """Append EOS after each document and each SFT response (so the model learns to stop); chats
    rendered with the tokenizer's chat template end each turn with the template's own tokens."""
    eos_id: int | None = None
    """EOS token id; None: the tokenizer's ``<|endoftext|>`` / ``</s>`` / eos token."""
    mask_prompt: bool = True
    """SFT: prompt tokens are not targets (label -100); False trains on the prompt too."""
    chat_template: ChatTemplateChoice = "auto"
    """Chat records: ``"auto"`` renders them with the tokenizer's chat template when it has one,
    else with the plain template; ``"tokenizer"`` requires the tokenizer's; ``"plain"`` always
    uses the plain one (``thdpack.data.records``)."""
    on_bad_record: OnBadRecord = "fail"
    """Records that cannot become samples (``thdpack.data.bad_records``): ``"fail"`` raises naming
    the record and what is wrong; ``"skip"`` skips them, counted per reason."""
    batch_size: int = 512
    """Records per ``encode_batch`` call (the tokenizer parallelises inside a batch)."""
    batch_chars: int = 4_000_000
    """Cut a batch early once its records hold this many characters: bounds memory when documents
    are huge (a tokenizer output costs ~100 bytes per token until it is converted)."""

    def __post_init__(self) -> None:
        if self.kind not in (*RECORD_KINDS, "auto"):
            raise ValueError(f"unknown record kind {self.kind!r}; use one of {['auto', *RECORD_KINDS]}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.batch_chars < 1:
            raise ValueError(f"batch_chars must be >= 1, got {self.batch_chars}")
        if self.eos_id is not None and self.eos_id < 0:
            raise ValueError(f"eos_id must be a token id >= 0, got {self.eos_id}")
        if self.chat_template not in CHAT_TEMPLATE_CHOICES:
            raise ValueError(f"unknown chat_template {self.chat_template!r}; use one of {list(CHAT_TEMPLATE_CHOICES)}")
        if self.on_bad_record not in ON_BAD_RECORD:
            raise ValueError(f"unknown on_bad_record {self.on_bad_record!r}; use one of {list(ON_BAD_RECORD)}")


@dataclass(frozen=True)
class TokenizedSample:
    """One record's token row and which tokens are training targets.

    ``tokens``: (n,) int64, n >= 2. ``target_mask``: (n,) bool, True where ``tokens[t]`` is a
    target (``target_mask[0]`` is never used: the first token has nothing before it).
    """

    tokens: np.ndarray
    target_mask: np.ndarray

    def as_labels(self) -> dict[str, np.ndarray]:
        """``{"input_ids": (n-1,) int64, "labels": (n-1,) int64}``; ``labels[t]`` is the target of t."""
        labels = np.where(self.target_mask[1:], self.tokens[1:], IGNORE_INDEX)
        return {"input_ids": self.tokens[:-1], "labels": labels}

    def as_loss_mask(self) -> dict[str, np.ndarray]:
        """``{"input_ids": (n,) int64, "loss_mask": (n,) int64}``; the last position predicts nothing."""
        loss_mask = np.zeros(len(self.tokens), dtype=np.int64)
        loss_mask[:-1] = self.target_mask[1:]
        return {"input_ids": self.tokens, "loss_mask": loss_mask}

    def to_sample(self, sample_format: SampleFormat = "labels") -> dict[str, np.ndarray]:
        """The sample as the packer takes it (see the module docstring)."""
        if sample_format == "labels":
            return self.as_labels()
        if sample_format == "loss_mask":
            return self.as_loss_mask()
        raise ValueError(f"unknown sample_format {sample_format!r}; use one of {list(SAMPLE_FORMATS)}")


@dataclass
class TokenizeReport:
    """Counts of one tokenization pass; every record is either a sample or counted as skipped:
    ``records == samples + skipped_too_short + skipped_no_target + skipped_bad``."""

    records: int = 0
    samples: int = 0
    tokens: int = 0
    """Tokens in the samples' rows (``tokens``, EOS included)."""
    target_tokens: int = 0
    """Tokens that are training targets (the loss tokens)."""
    skipped_too_short: int = 0
    """Records with fewer than 2 tokens: nothing to predict."""
    skipped_no_target: int = 0
    """Records whose tokens are all masked (e.g. an alpaca record with an empty output and no EOS)."""
    skipped_bad: int = 0
    """Bad records skipped under ``on_bad_record="skip"`` (their reasons: ``SampleEncoder.bad_records``)."""
    chat_template: int = 0
    """Chat records rendered with the tokenizer's own chat template (the others: the plain one)."""
    kinds: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        kinds = ", ".join(f"{k}: {v}" for k, v in sorted(self.kinds.items()))
        template = f"; {self.chat_template} chats in the tokenizer's chat template" if self.chat_template else ""
        return (
            f"{self.records} records ({kinds}) -> {self.samples} samples, {self.tokens} tokens "
            f"({self.target_tokens} targets); skipped {self.skipped_too_short} too short (< 2 tokens), "
            f"{self.skipped_no_target} without targets, {self.skipped_bad} bad{template}"
        )


Prepared = list[Segment] | RenderedChat
"""A record ready to encode: plain-template segments, or a chat rendered by the tokenizer's template."""
_Encoded = tuple[list[list[int]], list[tuple[list[int], np.ndarray]]]
"""``SampleEncoder._encode``: the ids of every segment, then ``(ids, offsets)`` of every rendered chat."""


class SampleEncoder:
    """Turns batches of records into ``TokenizedSample``s; ``report`` counts what it did.

    Args:
        tokenizer: a ``TextTokenizer``, or what ``load_tokenizer`` takes (``"gpt2"``, a path).
        config: the tokenization settings (default ``TokenizeConfig()``).
        bad_records: the bad-record policy and tally to use (shared with the sources of the same
            pass); by default a new one with ``config.on_bad_record``.
    """

    def __init__(
        self,
        tokenizer: TextTokenizer | str | os.PathLike[str] | Any,
        config: TokenizeConfig | None = None,
        *,
        bad_records: BadRecords | None = None,
    ):
        self.tokenizer = load_tokenizer(tokenizer)
        self.config = config or TokenizeConfig()
        self.eos_id = self.config.eos_id if self.config.eos_id is not None else self.tokenizer.eos_id
        if self.config.append_eos and self.eos_id is None:
            raise ValueError(
                f"tokenizer {self.tokenizer.name!r} has none of the EOS tokens {list(EOS_CANDIDATES)}; "
                "pass eos_id= (--eos-id) or append_eos=False (--no-eos)"
            )
        if self.eos_id is not None and self.eos_id >= self.tokenizer.vocab_size:
            raise ValueError(f"eos_id={self.eos_id} is outside the vocabulary (size {self.tokenizer.vocab_size})")
        if self.config.chat_template == "tokenizer" and self.tokenizer.chat_template is None:
            raise ValueError(
                f"chat_template='tokenizer' but tokenizer {self.tokenizer.name!r} has no chat template; pass a "
                "Hugging Face tokenizer folder with one (chat_template.jinja or 'chat_template' in "
                "tokenizer_config.json), or chat_template='auto' / 'plain' (--chat-template)"
            )
        self.chat_template = self.tokenizer.chat_template if self.config.chat_template != "plain" else None
        """The template that renders chat records; None: the plain template."""
        self.bad_records = bad_records or BadRecords(self.config.on_bad_record)
        self.report = TokenizeReport()

    def encode(
        self, records: Sequence[Mapping[str, Any]], origins: Sequence[str] | None = None
    ) -> list[TokenizedSample]:
        """Encode records in one tokenizer call; skipped records are counted, not returned.

        ``origins`` name the records in error messages ("data.jsonl line 7"); default "record i".
        """
        prepared = self._prepare(records, origins)
        return self._assemble(prepared, self._encode(prepared))

    def encode_stream(
        self, batches: Iterable[tuple[Sequence[Mapping[str, Any]], Sequence[str] | None]]
    ) -> Iterator[list[TokenizedSample]]:
        """``encode`` over a stream of ``(records, origins)`` batches, yielding each batch's samples.

        The tokenizer encodes the next batch in a worker thread while this thread assembles the
        current one (``tokenizers`` releases the GIL), so the tokenizer's threads are not left idle
        between batches. At most two batches are in flight.
        """
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="thdpack-tokenize") as pool:
            pending: tuple[list[Prepared], Future[_Encoded]] | None = None
            for records, origins in batches:
                prepared = self._prepare(records, origins)
                encoding = pool.submit(self._encode, prepared)
                if pending is not None:
                    yield self._assemble(pending[0], pending[1].result())
                pending = (prepared, encoding)
            if pending is not None:
                yield self._assemble(pending[0], pending[1].result())

    def _prepare(self, records: Sequence[Mapping[str, Any]], origins: Sequence[str] | None) -> list[Prepared]:
        """Each record's segments or rendered chat; bad records go to the ``bad_records`` policy."""
        prepared: list[Prepared] = []
        for i, record in enumerate(records):
            origin = origins[i] if origins is not None else f"record {self.report.records + i}"
            try:
                prepared.append(self._prepare_one(record, origin))
            except BadRecord as err:
                self.bad_records.handle(err)  # raises under on_bad_record="fail"
                self.report.skipped_bad += 1
        self.report.records += len(records)
        return prepared

    def _prepare_one(self, record: Mapping[str, Any], origin: str) -> Prepared:
        cfg = self.config
        if cfg.kind == "auto":
            kind = detect_kind(record, cfg.text_key, origin)
        else:
            kind = cfg.kind
            check_kind(record, kind, cfg.text_key, origin)
        self.report.kinds[kind] = self.report.kinds.get(kind, 0) + 1
        if kind == "chat" and self.chat_template is not None:
            rendered = self.chat_template.render(chat_messages(record, origin), origin)
            self.report.chat_template += 1
            return rendered
        return record_segments(
            record,
            kind,
            text_key=cfg.text_key,
            append_eos=cfg.append_eos,
            mask_prompt=cfg.mask_prompt,
            origin=origin,
        )

    def _encode(self, prepared: list[Prepared]) -> _Encoded:
        """Token ids of every segment, and ids with offsets of every rendered chat (in order)."""
        segments = [s.text for p in prepared if not isinstance(p, RenderedChat) for s in p]
        chats = [p.text for p in prepared if isinstance(p, RenderedChat)]
        return (
            self.tokenizer.encode_batch(segments) if segments else [],
            self.tokenizer.encode_batch_with_offsets(chats) if chats else [],
        )

    def _assemble(self, prepared: list[Prepared], encoded: _Encoded) -> list[TokenizedSample]:
        segment_ids, chat_ids = iter(encoded[0]), iter(encoded[1])
        samples: list[TokenizedSample] = []
        for item in prepared:
            if isinstance(item, RenderedChat):
                ids, offsets = next(chat_ids)
                mask = span_mask(offsets, item.spans) if self.config.mask_prompt else np.ones(len(ids), dtype=bool)
                self._add(samples, [ids], [mask])
                continue
            pieces: list[list[int]] = []
            marks: list[np.ndarray] = []
            for segment in item:
                seg_ids = next(segment_ids)
                if segment.eos:
                    seg_ids = [*seg_ids, self.eos_id]
                pieces.append(seg_ids)
                marks.append(np.full(len(seg_ids), segment.target))
            self._add(samples, pieces, marks)
        return samples

    def _add(self, samples: list[TokenizedSample], pieces: list[list[int]], marks: list[np.ndarray]) -> None:
        assert pieces, "every record kind yields at least one segment"
        if len(pieces) == 1:
            tokens, target_mask = np.asarray(pieces[0], dtype=np.int64), marks[0]
        else:
            tokens = np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces])
            target_mask = np.concatenate(marks)
        if len(tokens) < 2:
            self.report.skipped_too_short += 1
            return
        targets = int(target_mask[1:].sum())
        if targets == 0:
            self.report.skipped_no_target += 1
            return
        self.report.samples += 1
        self.report.tokens += len(tokens)
        self.report.target_tokens += targets
        samples.append(TokenizedSample(tokens, target_mask))


def span_mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """``(n,) bool``: True for the tokens whose ``[start, end)`` character offsets ``(n, 2)`` overlap
    one of the character ``spans``. A token cut by a span's edge is a target (as ``transformers``'
    assistant masks do): it holds characters the model has to produce.

    >>> offsets = np.array([[0, 5], [5, 7], [7, 12], [12, 22], [22, 23]])  # "hello", "\\n", "world", ...
    >>> span_mask(offsets, [(7, 22)]).tolist()
    [False, False, True, True, False]
    >>> span_mask(offsets, [(6, 8)]).tolist()
    [False, True, True, False, False]
    """
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(offsets), dtype=bool)
    for start, end in spans:
        mask |= (starts < end) & (ends > start)
    return mask


def record_batches(
    items: Iterable[T], config: TokenizeConfig, record_of: Callable[[T], Any] = lambda item: item
) -> Iterator[list[T]]:
    """Group ``items`` into tokenizer batches: ``config.batch_size`` records at most, cut early once
    they hold ``config.batch_chars`` characters. ``record_of`` finds the record in an item.

    >>> docs = [{"text": "x" * 5}] * 5
    >>> [len(b) for b in record_batches(docs, TokenizeConfig(batch_size=3, batch_chars=100))]
    [3, 2]
    >>> [len(b) for b in record_batches(docs, TokenizeConfig(batch_size=3, batch_chars=9))]
    [2, 2, 1]
    """
    batch: list[T] = []
    chars = 0
    for item in items:
        batch.append(item)
        chars += text_chars(record_of(item))
        if len(batch) == config.batch_size or chars >= config.batch_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def tokenize_records(
    records: Iterable[Mapping[str, Any]],
    tokenizer: TextTokenizer | str | os.PathLike[str] | Any = "gpt2",
    config: TokenizeConfig | None = None,
    *,
    total: int | None = None,
    progress: bool | None = None,
) -> Iterator[TokenizedSample]:
    """Stream ``TokenizedSample``s from records, one tokenizer call per batch (``SampleEncoder.encode_stream``).

    Args:
        records: the records (``thdpack.data.Source`` yields them).
        tokenizer: a ``TextTokenizer``, or what ``load_tokenizer`` takes.
        config: the tokenization settings (default ``TokenizeConfig()``).
        total: the number of records, for the progress bar.
        progress: a tqdm bar over records (None: only when stderr is a terminal).

    Yields:
        One ``TokenizedSample`` per record that makes a sample.
    """
    encoder = SampleEncoder(tokenizer, config)
    bar = progress_bar(total=total, desc="tokenize", unit="rec", enabled=progress)

    def read() -> Iterator[tuple[list[Mapping[str, Any]], None]]:
        for batch in record_batches(records, encoder.config):
            bar.update(len(batch))
            yield batch, None

    try:
        for samples in encoder.encode_stream(read()):
            yield from samples
    finally:
        bar.close()
