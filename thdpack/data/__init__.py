"""The data side: sources -> tokenization (with SFT masks, chat templates, a bad-record policy) -> token
store -> ``thdpack prepare``."""

from __future__ import annotations

from thdpack.data.bad_records import (
    BAD_RECORD_REASONS,
    ON_BAD_RECORD,
    BadRecord,
    BadRecordReason,
    BadRecords,
    OnBadRecord,
    RecordOrigin,
)
from thdpack.data.chat_template import ChatTemplate, RenderedChat
from thdpack.data.encode import (
    SAMPLE_FORMATS,
    SampleEncoder,
    SampleFormat,
    TokenizeConfig,
    TokenizedSample,
    TokenizeReport,
    record_batches,
    tokenize_records,
)
from thdpack.data.manifest import StoreBusyError, StoreError
from thdpack.data.records import RECORD_KINDS, RecordKind, Segment, chat_messages, detect_kind, record_segments
from thdpack.data.sources import (
    SOURCE_FORMATS,
    Source,
    SourceConfig,
    SourceFormat,
    SourceReport,
    detect_format,
)
from thdpack.data.store import TokenStore, TokenStoreWriter, read_manifest
from thdpack.data.store_verify import StoreVerification, verify_store
from thdpack.data.tokenizer import TextTokenizer, load_tokenizer

__all__ = [
    "BAD_RECORD_REASONS",
    "ON_BAD_RECORD",
    "RECORD_KINDS",
    "SAMPLE_FORMATS",
    "SOURCE_FORMATS",
    "BadRecord",
    "BadRecordReason",
    "BadRecords",
    "ChatTemplate",
    "OnBadRecord",
    "RecordKind",
    "RecordOrigin",
    "RenderedChat",
    "SampleEncoder",
    "SampleFormat",
    "Segment",
    "Source",
    "SourceConfig",
    "SourceFormat",
    "SourceReport",
    "StoreBusyError",
    "StoreError",
    "StoreVerification",
    "TextTokenizer",
    "TokenStore",
    "TokenStoreWriter",
    "TokenizeConfig",
    "TokenizeReport",
    "TokenizedSample",
    "chat_messages",
    "detect_format",
    "detect_kind",
    "load_tokenizer",
    "read_manifest",
    "record_batches",
    "record_segments",
    "tokenize_records",
    "verify_store",
]
