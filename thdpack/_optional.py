"""The one place that detects optional dependencies.

Everything else asks here, so a missing extra raises the same clear ``ImportError``
(naming the extra to install) at the point of use, and the pure-PyTorch paths stay
importable on any machine.

>>> has_module("numpy")
True
>>> has_module("surely_not_a_module_name")
False
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
from dataclasses import dataclass
from types import ModuleType

# extra name in pyproject.toml for each optional import root
_EXTRA_FOR = {
    "transformer_engine": "te",
    "flash_attn": "flash",
    "hydra": "hydra",
    "omegaconf": "hydra",
    "datasets": "hf",
    "tokenizers": "hf",
    "pyarrow": "hf",
    "transformers": "hf",
    "trl": "trl",
    "accelerate": "trl",
    "matplotlib": "train",
    "tqdm": "train",
    "numba": "fast",
}


@functools.cache
def has_module(name: str) -> bool:
    """True when ``import name`` would find the module (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def require(name: str, what: str) -> ModuleType:
    """Import ``name`` or raise ``ImportError`` naming the thdpack extra that provides it.

    ``what`` says what needed it, e.g. ``"the 'te' attention backend"``.
    """
    try:
        return importlib.import_module(name)
    except ImportError as err:
        root = name.split(".")[0]
        extra = _EXTRA_FOR.get(root)
        hint = f"pip install 'thdpack[{extra}]'" if extra else f"pip install {root}"
        raise ImportError(f"{what} needs {root!r}, which is not installed; {hint}") from err


@functools.cache
def has_transformer_engine() -> bool:
    """Transformer Engine's PyTorch bindings import (needs CUDA at import time)."""
    if not has_module("transformer_engine"):
        return False
    try:
        importlib.import_module("transformer_engine.pytorch")
        importlib.import_module("transformer_engine_torch")
    except Exception:  # TE raises assorted errors without CUDA / with a mismatched build
        return False
    return True


def parse_version(text: str) -> tuple[int, ...]:
    """The leading numeric release of a version string.

    >>> parse_version("2.18.0.dev0+abc"), parse_version("2.5")
    ((2, 18, 0), (2, 5))
    """
    numbers = re.match(r"\d+(?:\.\d+)*", text.strip())
    if numbers is None:
        raise ValueError(f"cannot read a version number from {text!r}")
    return tuple(int(part) for part in numbers.group(0).split("."))


@functools.cache
def transformer_engine_version() -> tuple[int, ...] | None:
    """The installed Transformer Engine's version, e.g. (2, 18, 0); None when it does not import."""
    if not has_transformer_engine():
        return None
    return parse_version(importlib.import_module("transformer_engine").__version__)


@dataclass(frozen=True)
class TransformerEngineKernels:
    """The attention kernels Transformer Engine found here, as its backend selection reads them."""

    cudnn: tuple[int, ...]
    """cuDNN's version (TE's ``get_cudnn_version``)."""
    flash_attn_2: bool
    """TE found flash-attn 2 it supports (``FlashAttentionUtils.is_installed``)."""
    flash_attn_3: bool
    """TE found flash-attn 3 (``FlashAttentionUtils.v3_is_installed``)."""


@functools.cache
def transformer_engine_kernels() -> TransformerEngineKernels | None:
    """What Transformer Engine's attention can call here; None when TE does not import."""
    if not has_transformer_engine():
        return None
    utils = importlib.import_module("transformer_engine.pytorch.utils")
    flash = importlib.import_module("transformer_engine.pytorch.attention.dot_product_attention.utils")
    found = flash.FlashAttentionUtils
    return TransformerEngineKernels(
        cudnn=tuple(utils.get_cudnn_version()),
        flash_attn_2=bool(found.is_installed),
        flash_attn_3=bool(found.v3_is_installed),
    )


@functools.cache
def has_flash_attn() -> bool:
    """flash-attn 2.x with ``flash_attn_varlen_func``."""
    if not has_module("flash_attn"):
        return False
    try:
        return hasattr(importlib.import_module("flash_attn"), "flash_attn_varlen_func")
    except Exception:
        return False


FLASH_ATTN_SINCE = (2, 6)
"""The first flash-attn whose ``flash_attn_varlen_func`` returns the LSE unpadded, (Nq, T): up to 2.5.9
it is padded per sequence, (S, Nq, max_seqlen) (``csrc/flash_attn/flash_api.cpp``, ``mha_varlen_fwd``)."""


@functools.cache
def flash_attn_version() -> tuple[int, ...] | None:
    """The installed flash-attn's version, e.g. (2, 8, 3); None when it does not import."""
    if not has_flash_attn():
        return None
    return parse_version(importlib.import_module("flash_attn").__version__)


@functools.cache
def has_varlen_attn() -> bool:
    """``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10)."""
    return has_module("torch.nn.attention.varlen")


@functools.cache
def has_flex_attention() -> bool:
    """``torch.nn.attention.flex_attention`` (torch >= 2.5)."""
    return has_module("torch.nn.attention.flex_attention")
