"""The data side: sources -> tokenization (with SFT masks, chat templates, a bad-record policy) -> token
store -> ``thdpack prepare``."""

from __future__ import annotations

from thdpack.data.encode import SampleEncoder, TokenizeConfig, tokenize_records
from thdpack.data.manifest import StoreError
from thdpack.data.sources import Source, SourceConfig
from thdpack.data.store import TokenStore, TokenStoreWriter, read_manifest
from thdpack.data.store_verify import verify_store
from thdpack.data.tokenizer import TextTokenizer, load_tokenizer

__all__ = [
    "SampleEncoder",
    "Source",
    "SourceConfig",
    "StoreError",
    "TextTokenizer",
    "TokenStore",
    "TokenStoreWriter",
    "TokenizeConfig",
    "load_tokenizer",
    "read_manifest",
    "tokenize_records",
    "verify_store",
]
