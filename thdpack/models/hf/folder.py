"""A local Hugging Face model folder (``model=hf`` with ``model.path``), loaded exactly or refused.

``from_pretrained`` is lenient where a training run must not be: it initialises missing weights
at random, drops unexpected ones and loads bidirectional encoders as causal LMs (the targets
leak). :func:`load_hf_folder` refuses each of these naming what it found, as well as shipped code
without ``model.trust_remote_code``, missing or damaged weight files, pickled weights that name
anything but tensors (never unpickled) and a ``config.json`` transformers rejects (the list:
docs/guides/hugging-face.md). :func:`folder_tokenizer` finds the tokenizer a folder ships, which
the trainer compares with the token store's.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from thdpack._optional import require
from thdpack.files.safe_load import UnsafeFileError, refused_global

FOLDER_FIX = "give a local Hugging Face model folder (as save_pretrained writes it: config.json + *.safetensors)"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_WEIGHTS = "pytorch_model.bin"
TORCH_WEIGHTS_INDEX = "pytorch_model.bin.index.json"
"""Pickled weights, which transformers still reads (weights-only; thdpack checks their globals first)."""
TRUST_SETTING = "model.trust_remote_code=true"
"""The setting that lets a model folder's own code run."""
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


def load_hf_folder(
    path: str, *, attn_implementation: str, dtype: torch.dtype, trust_remote_code: bool = False
) -> nn.Module:
    """The causal LM of the folder ``path`` with its weights exactly (see the module docstring for
    what is refused, each as a ``ValueError`` naming the file, the weights or the layers).

    ``trust_remote_code``: run the code ``config.json``'s ``auto_map`` names (``model.trust_remote_code``);
    without it such a folder is refused."""
    transformers = require("transformers", "model=hf")
    folder = config_json(path).parent
    check_remote_code(folder, trust_remote_code)
    files = weight_files(folder, path)
    check_weight_files(files)
    safetensors = require("safetensors", "model=hf")
    hub_errors = require("huggingface_hub.errors", "model=hf")
    try:
        hf, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder,
            attn_implementation=attn_implementation,
            dtype=dtype,
            local_files_only=True,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported in the loading info (then refused, named), not a bare RuntimeError
        )
    except hub_errors.StrictDataclassError as err:  # a config field transformers validates
        raise ValueError(f"{folder / 'config.json'}: transformers rejects it ({_one_line(err)})") from err
    except pickle.UnpicklingError as err:  # transformers' weights-only load refused what check_weight_files missed
        raise UnsafeFileError(_one_of(files), refused_global(err)) from None
    except (ValueError, OSError, safetensors.SafetensorError) as err:
        raise ValueError(f"cannot load model.path={path!r} as a causal LM: {_one_line(err)}") from err
    check_loading_info(folder, info)
    check_causal(hf, f"model.path={path!r}")
    return hf


def check_remote_code(folder: Path, trust_remote_code: bool) -> None:
    """``ValueError`` naming ``TRUST_SETTING`` when ``folder/config.json`` maps classes to code in the
    folder (``auto_map``) and ``trust_remote_code`` is off: loading it would run that code, and
    loading transformers' own class instead would train another model than the folder's."""
    file = folder / "config.json"
    try:
        auto_map = json.loads(file.read_text()).get("auto_map")
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"{file} is not a JSON object ({err}); {FOLDER_FIX}") from err
    if auto_map and not trust_remote_code:
        shown = ", ".join(f"{name}: {target}" for name, target in sorted(dict(auto_map).items()))
        raise ValueError(
            f"{file} maps its classes to code shipped with the model (auto_map {{{shown}}}), which thdpack does not "
            f"run unless told: read that code, then set {TRUST_SETTING}; or remove auto_map from config.json to "
            "load transformers' own class of its model_type"
        )


def weight_files(folder: Path, path: str) -> list[Path]:
    """The weight files of ``folder``: an index's shards, else ``model.safetensors``, else
    ``pytorch_model.bin`` (pickled); ``ValueError`` naming the folder and what it holds when it has no
    weights, or an index's missing shards."""
    for index_name in (SAFETENSORS_INDEX, TORCH_WEIGHTS_INDEX):
        index = folder / index_name
        if index.is_file():
            return _index_shards(index, folder)
    for name in (SAFETENSORS, TORCH_WEIGHTS):
        if (folder / name).is_file():
            return [folder / name]
    held = sorted(p.name for p in folder.iterdir())
    raise ValueError(
        f"model.path={path!r} holds no weights: expected {SAFETENSORS} (or {SAFETENSORS_INDEX} with its shards, "
        f"or {TORCH_WEIGHTS}) beside config.json, as save_pretrained writes them; {folder} holds {held}"
    )


def _index_shards(index: Path, folder: Path) -> list[Path]:
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(
            f"{index} is not a weights index (a JSON object with a 'weight_map': {err!r}); save the model again "
            "with save_pretrained"
        ) from err
    missing = [name for name in shards if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"{index} lists shards that {folder} lacks: {missing}; copy them into the folder")
    return [folder / name for name in shards]


def check_weight_files(files: Iterable[Path]) -> None:
    """Read each file's header before transformers loads it: a safetensors header, or a pickled
    file's zip directory and pickle (not its tensors). ``ValueError`` naming a file that is cut
    short or damaged (transformers reports it without naming it, or as "[Errno 22] Invalid
    argument"); ``UnsafeFileError`` naming a pickled file that names anything but tensors and
    plain values."""
    safetensors = require("safetensors", "model=hf")
    unreadable = (safetensors.SafetensorError, OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError)
    for file in files:
        safe = file.suffix == ".safetensors"
        try:
            if safe:
                with safetensors.safe_open(str(file), framework="pt"):
                    unsafe = []
            else:  # the globals its pickle names, read statically (transformers' weights-only load is the backstop)
                unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
        except unreadable as err:
            raise ValueError(
                f"{file} ({file.stat().st_size:,} bytes) is not a readable "
                f"{'safetensors' if safe else 'PyTorch (torch.save zip)'} file ({_one_line(err)}): it was cut short "
                "or damaged; copy it again, or save the model again"
            ) from err
        if unsafe:
            raise UnsafeFileError(file, f"the global{'s' * (len(unsafe) > 1)} {', '.join(sorted(unsafe))}")


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


def _one_of(files: list[Path]) -> Path | str:
    """The file among ``files`` (one), or "one of ..." naming them all."""
    return files[0] if len(files) == 1 else f"one of {', '.join(str(f) for f in files)}"


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())
