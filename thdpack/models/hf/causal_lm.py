"""A Hugging Face causal LM behind thdpack's model interface: ``model(thd, cp_group=...) -> logits_TV``.

The trainer's ``model=hf`` builds one from a local folder (``path``) or a random initialisation
of ``arch`` at given sizes. Its attention is thdpack's (registered as :data:`ATTENTION_NAME`), so
the same model trains on packed rows and on CP shards; :func:`save_hf_folder` writes a folder
transformers loads back with any of its own attention implementations. What CP requires of the
model: docs/guides/hugging-face.md.

Legend: ``T`` tokens of the batch (this rank's under CP), ``V`` vocabulary.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from thdpack._optional import require
from thdpack.attention.config import AttentionConfig
from thdpack.cp.topology import CpGroupLike
from thdpack.models.config import ModelConfig, check_head_sizes
from thdpack.models.hf.attention import ATTENTION_CONFIG_KWARG, hf_packed_kwargs, register_hf_attention
from thdpack.models.hf.folder import FOLDER_FIX, check_causal, config_json, load_hf_folder
from thdpack.thd.carriage import thd_meta

ATTENTION_NAME = "thdpack"
"""``attn_implementation`` of the models built here."""
ARCHITECTURES = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "mistral": "Mistral",
    "gemma": "Gemma",
}
"""``model.arch`` -> the transformers class prefix (``LlamaConfig``, ``LlamaForCausalLM``)."""
SIZE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")
_HF_SIZE_NAMES = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_dim": "intermediate_size",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "init_std": "initializer_range",
}


@dataclass(frozen=True, kw_only=True)
class HFModelConfig:
    """A Hugging Face causal LM (Hydra: ``model=hf``): a local folder, or an architecture at given sizes.

    >>> kwargs = HFModelConfig(arch="qwen2", dim=64).transformers_kwargs()
    >>> kwargs["hidden_size"], kwargs["num_hidden_layers"]   # the rest from the small preset
    (64, 2)
    >>> HFModelConfig(path="/models/x", dim=64)
    Traceback (most recent call last):
    ...
    ValueError: model.path='/models/x': its config.json decides the architecture and sizes, so model.dim=64 ...
    """

    path: str | None = None
    """A local folder with ``config.json`` and safetensors weights (nothing is downloaded)."""
    trust_remote_code: bool = False
    """Run the code a ``path`` folder ships (its ``config.json``'s ``auto_map``); off, such a folder
    is refused. Read that code first: it runs with the trainer's rights."""
    arch: str | None = None
    """Without ``path``: the architecture to initialise randomly (llama if None): llama, qwen2, mistral, gemma."""
    vocab_size: int | None = None
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    rope_theta: float | None = None
    norm_eps: float | None = None
    tie_embeddings: bool | None = None
    init_std: float | None = None
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    """The backend and CP exchange of thdpack's attention inside the model."""

    def __post_init__(self) -> None:
        set_fields = [name for name in (*_HF_SIZE_NAMES, "arch") if getattr(self, name) is not None]
        if self.path is not None and set_fields:
            shown = ", ".join(f"model.{name}={getattr(self, name)!r}".replace("'", "") for name in set_fields)
            raise ValueError(
                f"model.path={self.path!r}: its config.json decides the architecture and sizes, so {shown} would "
                "be ignored; drop it (and model.arch), or drop model.path for a random initialisation"
            )
        if self.trust_remote_code and self.path is None:
            raise ValueError(
                "model.trust_remote_code=true lets a model folder's own code run, and there is no model.path; "
                "drop it, or give the folder as model.path"
            )
        if self.path is None and (self.arch or "llama") not in ARCHITECTURES:
            raise ValueError(
                f"model.arch={self.arch!r} is not one of {', '.join(ARCHITECTURES)}; or give model.path, a local "
                "Hugging Face folder"
            )
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"model.{name} must be an int >= 1, got {value!r}")
        if self.path is None:  # what transformers would refuse with a traceback, named before building
            sizes = self.transformers_kwargs()
            check_head_sizes(
                dim=None if self.arch == "gemma" else sizes["hidden_size"],  # Gemma sets its head_dim apart
                n_heads=sizes["num_attention_heads"],
                n_kv_heads=sizes["num_key_value_heads"],
                prefix="model.",
            )

    def model_vocab_size(self) -> int:
        """The model's vocabulary: ``path``'s config.json, else ``vocab_size`` (the small preset's if None)."""
        if self.path is None:
            return self.vocab_size or ModelConfig.preset("small").vocab_size
        file = config_json(self.path)
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"model.path={self.path!r}: cannot read {file} ({err}); {FOLDER_FIX}") from err
        vocab = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
        if not isinstance(vocab, int):
            raise ValueError(f"{file} has no integer vocab_size (got {vocab!r})")
        return vocab

    def transformers_kwargs(self) -> dict[str, Any]:
        """The transformers config fields of a random initialisation: each size field that is
        None takes the value of thdpack's ``small`` preset (a tiny model, not transformers' 7B default)."""
        small = ModelConfig.preset("small")
        kwargs = {
            hf_name: getattr(small, name) if getattr(self, name) is None else getattr(self, name)
            for name, hf_name in _HF_SIZE_NAMES.items()
        }
        if (self.arch or "llama") == "mistral":
            kwargs["sliding_window"] = None  # full attention (Mistral v0.2+); thdpack attention has no windows
        return kwargs


class HFCausalLM(nn.Module):
    """``model(thd, cp_group=...) -> logits_TV`` for a transformers causal LM (``self.hf``).

    Every call goes through ``hf_packed_kwargs`` (positions reset per sequence, no cache, the THD
    metadata and the topology for thdpack's attention) and ``check_hf_attention``, so a model
    whose attention cannot be exact on the batch is refused before it runs.

    Args:
        hf_model: a transformers causal LM with thdpack's attention registered (``build_hf_model``).
        attention: the backend and CP exchange of thdpack's attention inside it (default:
            ``AttentionConfig()``).
    """

    def __init__(self, hf_model: nn.Module, attention: AttentionConfig | None = None) -> None:
        super().__init__()
        self.hf = hf_model
        self.attention = attention or AttentionConfig()

    @property
    def config(self) -> Any:
        return self.hf.config

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers (what FSDP2 and activation checkpointing wrap one by one)."""
        return self.hf.model.layers

    def forward(self, thd: Mapping[str, Any], *, cp_group: CpGroupLike | None = None) -> torch.Tensor:
        """(T, V) logits of the tokens of ``thd`` (a THD batch or a CP shard, on the model's device)."""
        sharded = thd_meta(thd).cp_size > 1
        kwargs = hf_packed_kwargs(thd, cp_group=cp_group if sharded else None, model=self.hf)
        kwargs[ATTENTION_CONFIG_KWARG] = self.attention
        return self.hf(**kwargs).logits[0]


def build_hf_model(
    config: HFModelConfig, *, seed: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> HFCausalLM:
    """The model of ``config`` with thdpack's attention, its parameters in ``dtype`` on ``device``.

    Args:
        config: a local folder (``path``) or an architecture and its sizes.
        seed: a random initialisation draws from ``torch.manual_seed(seed)`` on the CPU, so every
            rank that builds it with the same seed holds identical weights.
        device, dtype: where the parameters live and their dtype.

    Returns:
        The ``HFCausalLM``. A folder loads with its weights exactly and only when its model is a
        causal LM (``thdpack.models.hf.folder.load_hf_folder`` names what is missing, damaged or
        bidirectional).
    """
    transformers = require("transformers", "model=hf")
    register_hf_attention(ATTENTION_NAME)
    if config.path is not None:
        hf = load_hf_folder(
            config.path,
            attn_implementation=ATTENTION_NAME,
            dtype=dtype or torch.float32,
            trust_remote_code=config.trust_remote_code,
        )
    else:
        prefix = ARCHITECTURES[config.arch or "llama"]
        hf_config = getattr(transformers, f"{prefix}Config")(**config.transformers_kwargs())
        hf_config._attn_implementation = ATTENTION_NAME
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            hf = getattr(transformers, f"{prefix}ForCausalLM")(hf_config)
        if dtype is not None:
            hf = hf.to(dtype)
        check_causal(hf, f"model.arch={config.arch or 'llama'}")
    hf.config.use_cache = False
    hf.train()
    return HFCausalLM(hf, config.attention).to(device)


def save_hf_folder(
    model: HFCausalLM,
    folder: Path,
    *,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    tokenizer: str | None = None,
) -> Path:
    """``save_pretrained`` into ``folder`` (config.json + model.safetensors), loadable by plain
    transformers with its own attention.

    Args:
        model: the model to save.
        folder: where to (created).
        state_dict: the full weights keyed like ``model.hf`` (FSDP2 gathers them first; None: the
            model's own).
        tokenizer: a tokenizer folder or tokenizer.json whose files are copied along.

    Returns:
        ``folder``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    # transformers does not save attn_implementation: the folder loads with its own attention
    model.hf.save_pretrained(folder, state_dict=dict(state_dict) if state_dict is not None else None)
    if tokenizer is not None:
        _copy_tokenizer(Path(tokenizer).expanduser(), folder)
    return folder


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _copy_tokenizer(source: Path, folder: Path) -> None:
    if source.is_file():
        shutil.copy2(source, folder / "tokenizer.json")
        return
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, folder / name)
