"""Tokenizers: the shipped GPT-2 BPE, a ``tokenizer.json``, a Hugging Face tokenizer folder, or a
tokenizer object, wrapped with what a token store records (name, sha256, the vocabulary's
digest, vocabulary size, EOS, the tokenizer's own chat template). ``thdpack.data.encode`` turns
records into samples with it.

>>> load_tokenizer("gpt2").encode_batch(["Hello world"])
[[15496, 995]]
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from thdpack._optional import require
from thdpack.data.chat_template import ChatTemplate

ASSETS = Path(__file__).resolve().parents[1] / "assets"
SHIPPED_TOKENIZERS = {"gpt2": ASSETS / "gpt2_tokenizer.json"}
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
"""The tokens taken as EOS, in this order, when a tokenizer names none."""


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with what a token store records: name, sha256, vocab size, EOS,
    and the tokenizer's own chat template when it has one (``load_tokenizer`` makes one).

    Args:
        backend: the ``tokenizers.Tokenizer``.
        name: what the store records as the tokenizer (``"gpt2"``, a path).
        sha256: the digest of its file.
        eos_id: the EOS token's id (None: none is appended).
        chat_template: the tokenizer's own chat template, when it has one.
    """

    def __init__(
        self, backend: Any, *, name: str, sha256: str, eos_id: int | None, chat_template: ChatTemplate | None = None
    ) -> None:
        self.backend = backend
        self.name = name
        self.sha256 = sha256
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.eos_id = eos_id
        self.chat_template = chat_template
        # encode_batch_fast (tokenizers >= 0.21) skips offsets, which only rendered chats need
        self._encode = getattr(backend, "encode_batch_fast", backend.encode_batch)

    @functools.cached_property
    def vocab_sha256(self) -> str:
        """sha256 of the vocabulary: every token and its id, added tokens included, however the
        tokenizer's file is formatted. Equal digests: every id means the same token in both
        tokenizers (what a model trained on the ids relies on)."""
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return hashlib.sha256(json.dumps(vocab, sort_keys=True).encode()).hexdigest()

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, without the tokenizer's special-token template."""
        return [e.ids for e in self._encode(list(texts), add_special_tokens=False)]

    def encode_batch_with_offsets(self, texts: Sequence[str]) -> list[tuple[list[int], np.ndarray]]:
        """``(ids, offsets)`` of each text: ``offsets`` (n, 2) int64, the ``[start, end)`` characters
        of the text each token came from."""
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=False)
        return [(e.ids, np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2)) for e in encodings]

    def __repr__(self) -> str:
        template = f", chat_template={self.chat_template.source!r}" if self.chat_template else ""
        return f"TextTokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id}{template})"


def load_tokenizer(spec: str | os.PathLike[str] | Any) -> TextTokenizer:
    """``"gpt2"`` (shipped), a ``tokenizer.json`` path, a tokenizer folder, or a tokenizer object.

    A folder holds ``tokenizer.json`` and optionally ``tokenizer_config.json`` (its ``eos_token``
    is the EOS) and a chat template. Objects: a ``tokenizers.Tokenizer``, or a fast
    ``transformers`` tokenizer (its ``backend_tokenizer`` encodes; its ``eos_token_id`` is the EOS,
    its ``chat_template`` renders chats).

    Args:
        spec: ``"gpt2"``, a path, or a tokenizer object.

    Returns:
        The ``TextTokenizer``. Raises ``ValueError`` for a path that is missing or not a tokenizer,
        ``TypeError`` for other objects.
    """
    if isinstance(spec, TextTokenizer):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        return _load_from_path(spec)
    tokenizers = require("tokenizers", "tokenizing text")
    if isinstance(spec, tokenizers.Tokenizer):
        sha = hashlib.sha256(spec.to_str().encode()).hexdigest()
        return TextTokenizer(spec, name="tokenizers.Tokenizer", sha256=sha, eos_id=_find_eos(spec))
    backend = getattr(spec, "backend_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer):
        sha = hashlib.sha256(backend.to_str().encode()).hexdigest()
        eos = getattr(spec, "eos_token_id", None)
        name = str(getattr(spec, "name_or_path", "") or type(spec).__name__)
        eos = eos if eos is not None else _find_eos(backend)
        template = ChatTemplate.from_transformers(spec)
        return TextTokenizer(backend, name=name, sha256=sha, eos_id=eos, chat_template=template)
    raise TypeError(
        f"cannot use a {type(spec).__name__} as a tokenizer; pass 'gpt2', a tokenizer.json path, a "
        "tokenizers.Tokenizer or a fast transformers tokenizer (one with .backend_tokenizer)"
    )


def _load_from_path(spec: str | os.PathLike[str]) -> TextTokenizer:
    tokenizers = require("tokenizers", "tokenizing text")
    name = str(spec)
    path = SHIPPED_TOKENIZERS.get(name, Path(spec))
    folder = path if path.is_dir() else None
    if folder is not None:
        path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f"tokenizer {name!r} is neither a shipped one ({sorted(SHIPPED_TOKENIZERS)}) nor an existing "
            "tokenizer.json (or a Hugging Face tokenizer folder holding one; slow-only tokenizers without "
            "a tokenizer.json are not supported: save a fast one with save_pretrained)"
        )
    data = path.read_bytes()
    try:
        backend = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as err:  # tokenizers raises a bare Exception for bad JSON / unknown models
        raise ValueError(
            f"cannot read {path} as a Hugging Face tokenizer.json ({err}); pass 'gpt2' or a valid tokenizer.json"
        ) from err
    eos_id = _config_eos(folder, backend) if folder is not None else None
    return TextTokenizer(
        backend,
        name=name,
        sha256=hashlib.sha256(data).hexdigest(),
        eos_id=eos_id if eos_id is not None else _find_eos(backend),
        chat_template=ChatTemplate.from_folder(folder) if folder is not None else None,
    )


def _config_eos(folder: Path, backend: Any) -> int | None:
    """The id of ``eos_token`` in the folder's ``tokenizer_config.json`` (a string or an
    ``{"content": ...}`` added-token entry), or None when it names none the vocabulary holds."""
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    try:
        token = json.loads(config_path.read_text(encoding="utf-8")).get("eos_token")
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_path} is not valid JSON ({err.msg}, line {err.lineno})") from err
    if isinstance(token, dict):
        token = token.get("content")
    token_id = backend.token_to_id(token) if isinstance(token, str) else None
    return int(token_id) if token_id is not None else None


def _find_eos(backend: Any) -> int | None:
    for token in EOS_CANDIDATES:
        token_id = backend.token_to_id(token)
        if token_id is not None:
            return int(token_id)
    return None
