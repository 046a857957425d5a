"""A local Hugging Face model folder (``model=hf`` with ``model.path``): what it must hold, and
loading it with every mismatch named instead of trained around.

``transformers.AutoModelForCausalLM.from_pretrained`` is lenient where a training run must not
be: weights that ``config.json`` expects and the safetensors lack are initialised at random
(a "MISSING ... newly initialized" report), weights it does not expect are dropped, and any
architecture with a causal-LM head loads, bidirectional encoders included (a ``BertForMaskedLM``
folder loads as ``BertLMHeadModel``, whose attention sees later tokens, so the targets leak).
:func:`load_hf_folder` refuses each of these, naming what it found:

- no weights (``model.safetensors``, ``model.safetensors.index.json`` and its shards, or
  ``pytorch_model.bin``): the folder and what it holds;
- a safetensors file cut short or damaged: the file (each header is read before loading);
- a ``config.json`` transformers rejects (an odd head dim, a hidden size its heads do not
  divide, an unknown ``model_type``): the file and transformers' reason;
- missing, unexpected or mis-shaped weights: their names;
- attention that is not causal (an attention layer with ``is_causal=False``, or none that
  declares ``is_causal``): the model class, ``model_type``, ``architectures`` and the layers.

:func:`folder_tokenizer` finds the tokenizer a folder ships, which the trainer compares with the
token store's (``thdpack.train.store_cache.check_model_tokenizer``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from thdpack._optional import require

FOLDER_FIX = "give a local Hugging Face model folder (as save_pretrained writes it: config.json + *.safetensors)"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
"""Pickled weights, which transformers still reads (thdpack reads no header of them)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Files that say a model folder ships a tokenizer (thdpack reads ``tokenizer.json``)."""
_SHOWN = 8
"""Names listed per kind of mismatch; the rest are counted."""


def config_json(path: str) -> Path:
    """``path/config.json``; ``ValueError`` naming ``model.path`` when the folder has none."""
    file = Path(path).expanduser() / "config.json"
    if not file.is_file():
        raise ValueError(f"model.path={path!r} holds no config.json: {FOLDER_FIX}")
    return file


def load_hf_folder(path: str, *, attn_implementation: str, dtype: torch.dtype) -> nn.Module:
    """The causal LM of the folder ``path`` with its weights exactly (see the module docstring for
    what is refused, each as a ``ValueError`` naming the file, the weights or the layers)."""
    transformers = require("transformers", "model=hf")
    folder = config_json(path).parent
    shards = weight_files(folder, path)
    check_safetensors(shards)
    safetensors = require("safetensors", "model=hf")
    hub_errors = require("huggingface_hub.errors", "model=hf")
    try:
        hf, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder,
            attn_implementation=attn_implementation,
            dtype=dtype,
            local_files_only=True,
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported in the loading info (then refused, named), not a bare RuntimeError
        )
    except hub_errors.StrictDataclassError as err:  # a config field transformers validates
        raise ValueError(f"{folder / 'config.json'}: transformers rejects it ({_one_line(err)})") from err
    except (ValueError, OSError, safetensors.SafetensorError) as err:
        raise ValueError(f"cannot load model.path={path!r} as a causal LM: {_one_line(err)}") from err
    check_loading_info(folder, info)
    check_causal(hf, f"model.path={path!r}")
    return hf


def weight_files(folder: Path, path: str) -> list[Path]:
    """The safetensors files of ``folder`` (the index's shards, or ``model.safetensors``); ``[]``
    for pickled torch weights; ``ValueError`` naming the folder and what it holds when it has no
    weights, or the index's missing shards."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(
                f"{index} is not a safetensors index (a JSON object with a 'weight_map': {err!r}); save the model "
                "again with save_pretrained"
            ) from err
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            raise ValueError(f"{index} lists shards that {folder} lacks: {missing}; copy them into the folder")
        return [folder / name for name in shards]
    if (folder / SAFETENSORS).is_file():
        return [folder / SAFETENSORS]
    if any((folder / name).is_file() for name in TORCH_WEIGHTS):
        return []
    held = sorted(p.name for p in folder.iterdir())
    raise ValueError(
        f"model.path={path!r} holds no weights: expected {SAFETENSORS} (or {SAFETENSORS_INDEX} with its shards, "
        f"or {TORCH_WEIGHTS[0]}) beside config.json, as save_pretrained writes them; {folder} holds {held}"
    )


def check_safetensors(files: Iterable[Path]) -> None:
    """Read each file's safetensors header (not its tensors): ``ValueError`` naming a file that is
    cut short or damaged, which transformers reports without naming it."""
    safetensors = require("safetensors", "model=hf")
    for file in files:
        try:
            with safetensors.safe_open(str(file), framework="pt"):
                pass
        except (safetensors.SafetensorError, OSError) as err:
            size = file.stat().st_size
            raise ValueError(
                f"{file} ({size:,} bytes) is not a readable safetensors file ({_one_line(err)}): it was cut short or "
                "damaged; copy it again, or save the model again"
            ) from err


def check_loading_info(folder: Path, info: Mapping[str, Any]) -> None:
    """``ValueError`` naming the weights ``config.json`` expects and the files lack (transformers
    would initialise them at random), those the files hold and it does not expect (dropped), and
    those of another shape; ``info`` is ``from_pretrained``'s ``output_loading_info``."""
    kinds = (
        ("missing_keys", "missing from its weights (transformers would initialise them at random)"),
        ("unexpected_keys", "in its weights but not in the model config.json describes (they would be dropped)"),
        ("mismatched_keys", "of another shape than config.json describes"),
    )
    problems = []
    for key, meaning in kinds:
        names = sorted(_weight_name(entry) for entry in info.get(key) or ())
        if names:
            shown = ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
            problems.append(f"{len(names)} tensors {meaning}: {shown}")
    problems += [_one_line(message) for message in info.get("error_msgs") or ()]
    if problems:
        raise ValueError(
            f"{folder}: its config.json and its weights disagree: {'; '.join(problems)}; fix config.json (e.g. "
            "num_hidden_layers, the sizes) or save the model again with save_pretrained"
        )


def check_causal(model: nn.Module, origin: str) -> None:
    """``ValueError`` unless every attention layer of ``model`` declares ``is_causal=True``
    (transformers' attention modules carry it; thdpack's attention reads it). A bidirectional
    model would let every position see its targets."""
    flags = {name: module.is_causal for name, module in model.named_modules() if hasattr(module, "is_causal")}
    bidirectional = [name for name, causal in flags.items() if causal is not True]
    if flags and not bidirectional:
        return
    config = getattr(model, "config", None)
    found = (
        f"{type(model).__name__} (model_type {getattr(config, 'model_type', None)!r}, "
        f"architectures {getattr(config, 'architectures', None)})"
    )
    if not flags:
        what = "none of its layers declares is_causal, so its attention may see later tokens"
    else:
        shown = ", ".join(bidirectional[:_SHOWN]) + (" ..." if len(bidirectional) > _SHOWN else "")
        what = f"its attention layers {shown} are bidirectional (is_causal=False): every position sees its targets"
    raise ValueError(
        f"{origin} is a {found}: {what}; thdpack trains causal language models only (Llama, Qwen2, Mistral, "
        "Gemma and other decoders whose attention is causal)"
    )


def folder_tokenizer(path: str) -> Path | None:
    """``path`` when the model folder ships a tokenizer (any of ``TOKENIZER_FILES``), else None."""
    folder = Path(path).expanduser()
    return folder if any((folder / name).is_file() for name in TOKENIZER_FILES) else None


def _weight_name(entry: Any) -> str:
    """A name of the loading info; a mismatched one comes as (name, shape in the files, shape of the model)."""
    if isinstance(entry, tuple) and len(entry) == 3:
        name, stored, expected = entry
        return f"{name} ({list(stored)} in the files, {list(expected)} by config.json)"
    return str(entry)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())
