"""``ModelConfig``: the settings of thdpack's reference decoder, and its named presets.

>>> ModelConfig.preset("tiny").head_dim
8
>>> ModelConfig(dim=96, n_heads=4, n_kv_heads=3)
Traceback (most recent call last):
...
ValueError: n_heads=4 is not a multiple of n_kv_heads=3; grouped-query attention shares each KV head ...
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args

from thdpack.attention.config import CP_COMM_TYPES, Backend, CpCommType, check_backend

ModelPreset = Literal["tiny", "small"]
MODEL_PRESETS: tuple[ModelPreset, ...] = get_args(ModelPreset)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Llama-style decoder (Hydra: ``model/``). The defaults are the CPU training default
    (the ``"small"`` preset): 2 layers, dim 128, 4 query heads sharing 2 KV heads, GPT-2's vocabulary."""

    vocab_size: int = 50257
    """Embedding rows and logits per token (50257 = the GPT-2 tokenizer shipped in thdpack/assets)."""
    dim: int = 128
    """Model (residual stream) width D."""
    n_layers: int = 2
    """Decoder blocks."""
    n_heads: int = 4
    """Query heads; the head dim is ``dim // n_heads`` and must be even (RoPE rotates pairs)."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); ``n_heads % n_kv_heads == 0``."""
    ffn_dim: int = 384
    """Hidden width of the SwiGLU MLP (Llama: about 8/3 * dim, rounded up)."""
    rope_theta: float = 10000.0
    """RoPE base: pair ``i`` of a head rotates by ``position * rope_theta ** (-2i / head_dim)``."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = True
    """The LM head reuses the token embedding matrix."""
    init_std: float = 0.02
    """Standard deviation of the normal weight init; the residual output projections (``o_proj``,
    ``down_proj``) use ``init_std / sqrt(2 * n_layers)`` (GPT-2's scaling)."""
    attention_backend: Backend = "auto"
    """``thd_attention`` backend of every layer; ``"auto"`` picks the fastest available and logs why."""
    causal: bool = True
    """Decoder (causal) attention inside each sequence; False = bidirectional within each sequence."""
    cp_comm_type: CpCommType = "p2p"
    """Context-parallel K/V exchange: ``"p2p"`` ring or ``"all_gather"``."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"dim={self.dim} is not a multiple of n_heads={self.n_heads}; pick n_heads that divides dim"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head dim dim // n_heads = {self.head_dim} is odd; RoPE rotates pairs of channels, so use an "
                "even head dim"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}; grouped-query "
                "attention shares each KV head between n_heads // n_kv_heads query heads"
            )
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        check_backend(self.attention_backend)
        if self.cp_comm_type not in CP_COMM_TYPES:
            valid = ", ".join(repr(c) for c in CP_COMM_TYPES)
            raise ValueError(f"unknown cp_comm_type {self.cp_comm_type!r}; valid: {valid}")
        for name in ("tie_embeddings", "causal"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def head_dim(self) -> int:
        """H, channels per attention head."""
        return self.dim // self.n_heads

    @classmethod
    def preset(cls, name: ModelPreset, **overrides: Any) -> ModelConfig:
        """A named configuration with some fields replaced.

        ``"tiny"``: vocab 64, dim 32, 2 layers, 4 heads / 2 KV heads, ffn 64 (tests, ``thdpack
        verify``). ``"small"``: the defaults, the CPU training model.

        >>> ModelConfig.preset("tiny", n_layers=1).n_layers
        1
        >>> ModelConfig.preset("huge")
        Traceback (most recent call last):
        ...
        ValueError: unknown model preset 'huge'; valid: 'tiny', 'small'
        """
        if name not in MODEL_PRESETS:
            valid = ", ".join(repr(p) for p in MODEL_PRESETS)
            raise ValueError(f"unknown model preset {name!r}; valid: {valid}")
        base = _TINY if name == "tiny" else cls()
        return dataclasses.replace(base, **overrides)


_TINY = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
