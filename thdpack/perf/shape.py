"""ModelShape: the sizes of a decoder that set its FLOPs and bytes per token.

Built from thdpack's ``ModelConfig`` (or anything with its field names), from a Hugging Face
``config.json`` mapping, or from explicit fields. FLOPs count 2 per multiply-add; the backward of a
linear layer costs twice its forward (the gradients of the input and of the weight).

>>> gpt = ModelShape(layers=12, hidden=2048, ffn=8192, heads=16, kv_heads=16, head_dim=128, vocab=131072,
...                  gated_mlp=False)
>>> gpt.layer_flops_per_token / 1e6     # forward: QKV 3 x 2048^2, out 2048^2, MLP 2 x 2048 x 8192, x2
100.663296
>>> gpt.head_flops_per_token / 1e6      # the logits: 2048 x 131072, x2
536.870912
>>> gpt.kv_bytes_per_token              # K and V, 16 heads of 128, bf16
8192
>>> ModelShape.from_hf_config({"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
...     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}).parameters() / 1e9
8.030261248
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from thdpack.perf.machine import read_json_object

ATTENTION_BACKWARD_FACTOR = 2.5
"""Backward FLOPs of an attention block per forward FLOP (FlashAttention's convention: five
matmuls against two)."""
UNGATED_MODEL_TYPES = frozenset(
    {"gpt2", "gpt_neox", "gptj", "gpt_bigcode", "opt", "bloom", "falcon", "mpt", "phi", "bert"}
)
"""Hugging Face ``model_type`` values whose MLP has two matrices (the rest are gated, as Llama's);
a ``gated_mlp`` key in the mapping overrides it."""


def _check_size(name: str, value: object) -> None:
    """``ValueError`` unless ``value`` is an int >= 1 (a size of the model)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A decoder's sizes (all integers >= 1)."""

    layers: int
    """Decoder blocks."""
    hidden: int
    """Model width."""
    ffn: int
    """MLP hidden width."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key / value heads (grouped-query attention)."""
    head_dim: int
    """Channels per head."""
    vocab: int
    """Vocabulary (logits per token)."""
    gated_mlp: bool = True
    """SwiGLU-style MLP (three matrices) rather than two."""
    tied_embeddings: bool = True
    """The output projection shares the embedding matrix (one copy of the parameters)."""
    itemsize: int = 2
    """Bytes per activation element (bf16)."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "ffn", "heads", "kv_heads", "head_dim", "vocab", "itemsize"):
            _check_size(f"ModelShape.{name}", getattr(self, name))
        if self.heads % self.kv_heads:
            raise ValueError(
                f"ModelShape.heads={self.heads} is not a multiple of kv_heads={self.kv_heads}; each KV head serves "
                "heads // kv_heads query heads"
            )

    @classmethod
    def from_model_config(cls, config: Any) -> ModelShape:
        """The shape of thdpack's ``ModelConfig`` (read by field name, so torch is not imported here)."""
        return cls(
            layers=config.n_layers,
            hidden=config.dim,
            ffn=config.ffn_dim,
            heads=config.n_heads,
            kv_heads=config.n_kv_heads,
            head_dim=config.dim // config.n_heads,
            vocab=config.vocab_size,
            gated_mlp=True,
            tied_embeddings=config.tie_embeddings,
        )

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """The shape of a Hugging Face ``config.json`` (Llama / Qwen / Mistral / GPT-2 field names;
        ``ValueError`` naming the first size it cannot find)."""

        def field(*names: str, default: Any = None) -> Any:
            for name in names:
                if config.get(name) is not None:
                    return config[name]
            if default is None:
                raise ValueError(f"config.json has none of {', '.join(names)}; cannot size the model")
            return default

        hidden = field("hidden_size", "n_embd", "d_model")
        heads = field("num_attention_heads", "n_head")
        head_dim = config.get("head_dim")
        if head_dim is None:  # the models that omit it take hidden // heads, and need it whole
            _check_size("config.json: num_attention_heads", heads)
            _check_size("config.json: hidden_size", hidden)
            if hidden % heads:
                raise ValueError(
                    f"config.json: hidden_size {hidden!r} is not a multiple of num_attention_heads {heads}, and no "
                    "head_dim is given; give head_dim or sizes that divide"
                )
            head_dim = hidden // heads
        return cls(
            layers=field("num_hidden_layers", "n_layer"),
            hidden=hidden,
            ffn=field("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden),
            heads=heads,
            kv_heads=field("num_key_value_heads", default=heads),
            head_dim=head_dim,
            vocab=field("vocab_size"),
            gated_mlp=bool(config.get("gated_mlp", config.get("model_type") not in UNGATED_MODEL_TYPES)),
            tied_embeddings=bool(field("tie_word_embeddings", default=False)),
        )

    @property
    def layer_flops_per_token(self) -> float:
        """Forward FLOPs of one decoder block's linear layers per token (QKV, output, MLP)."""
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        out = self.heads * self.head_dim * self.hidden
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return 2.0 * (qkv + out + mlp)

    @property
    def head_flops_per_token(self) -> float:
        """Forward FLOPs of the logits per token."""
        return 2.0 * self.hidden * self.vocab

    def linear_flops_per_token(self) -> float:
        """Forward + backward FLOPs of every linear layer and the logits per token (3x forward)."""
        return 3.0 * (self.layers * self.layer_flops_per_token + self.head_flops_per_token)

    def attention_flops_per_pair(self) -> float:
        """Forward FLOPs of one (query, key) pair in one layer: ``QK^T`` and ``PV`` over every head."""
        return 4.0 * self.heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's K and V in one layer (what a ring step sends)."""
        return 2 * self.kv_heads * self.head_dim * self.itemsize

    def qkv_bytes_per_token(self, copies: Any = 1) -> Any:
        """Bytes of one token's Q, K and V, K and V with each head repeated ``copies`` times (an int
        or an array of them)."""
        return (self.heads + 2 * self.kv_heads * copies) * self.head_dim * self.itemsize

    def out_bytes_per_token(self) -> int:
        """Bytes of one token's attention output (every query head)."""
        return self.heads * self.head_dim * self.itemsize

    def kv_copies(self, cp_size: int) -> int:
        """How many copies of each KV head an all-to-all over ``cp_size`` ranks sends:
        ``lcm(kv_heads, cp_size) / kv_heads`` (``thdpack.attention.heads.kv_replication``)."""
        return math.lcm(self.kv_heads, cp_size) // self.kv_heads

    def parameters(self) -> int:
        """Parameters: embeddings (twice when untied), every block's matrices and norms, the final norm."""
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        block = qkv + self.heads * self.head_dim * self.hidden + (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        block += 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * block + embeddings + self.hidden


NAMED_SHAPES: dict[str, ModelShape] = {
    # Megatron-LM's dynamic-CP benchmark model (examples/dynamic_context_parallel/benchmark_dcp.sh):
    # GPT, 12 layers, hidden 2048, FFN 8192, 16 heads (no GQA), vocabulary 131072, GELU MLP, tied
    "megatron-dcp-gpt": ModelShape(
        layers=12, hidden=2048, ffn=8192, heads=16, kv_heads=16, head_dim=128, vocab=131072, gated_mlp=False
    ),
    # Llama 3 8B (meta-llama/Meta-Llama-3-8B config.json)
    "llama3-8b": ModelShape(
        layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, tied_embeddings=False
    ),
}
"""Public model shapes by name."""


def load_shape(spec: str | Path) -> ModelShape:
    """A model shape from a file or a name.

    Args:
        spec: a JSON file (``ModelShape``'s own fields, or a Hugging Face ``config.json``), a name
            of ``NAMED_SHAPES``, or a thdpack ``ModelConfig`` preset (``tiny``, ``small``, ``114m``;
            loading a preset imports torch, as ``thdpack.models`` does).

    Returns:
        The ``ModelShape``; ``ValueError`` names an unknown field or name and the valid ones.
    """
    path = Path(spec)
    if path.is_file():
        data = read_json_object(path, "model config")
        own = {f.name for f in fields(ModelShape)}
        if "layers" in data:
            unknown = sorted(set(data) - own)
            if unknown:
                raise ValueError(f"model config {path}: unknown ModelShape field {unknown[0]!r}; valid: {sorted(own)}")
            return ModelShape(**data)
        return ModelShape.from_hf_config(data)
    name = str(spec)
    if name in NAMED_SHAPES:
        return NAMED_SHAPES[name]
    from thdpack.models.config import MODEL_PRESETS, ModelConfig

    if name in MODEL_PRESETS:
        return ModelShape.from_model_config(ModelConfig.preset(name))
    valid = ", ".join([*NAMED_SHAPES, *MODEL_PRESETS])
    raise ValueError(f"unknown model {name!r}: not a file, and not one of {valid} (or a path to a config.json)")
