"""``ModelConfig``: the settings of thdpack's reference decoder, and its named presets.

The attention settings are one :class:`~thdpack.attention.AttentionConfig` (``attention``),
passed to every layer's ``thd_attention`` as it is. Presets: ``"tiny"`` (tests and ``thdpack
verify``), ``"small"`` (the defaults, the CPU training model) and ``"114m"`` (the GPU model);
``configs/model/<name>.yaml`` holds the same fields for the trainable ones.

>>> ModelConfig.preset("tiny").head_dim
8
>>> ModelConfig.preset("tiny", attention=AttentionConfig(backend="math")).attention.backend
'math'
>>> ModelConfig(dim=96, n_heads=4, n_kv_heads=3)
Traceback (most recent call last):
...
ValueError: n_heads=4 is not a multiple of n_kv_heads=3; grouped-query attention shares each KV head ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from thdpack.attention.config import AttentionConfig

ModelPreset = Literal["tiny", "small", "114m"]
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
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    """How every layer's ``thd_attention`` runs: backend (``"auto"`` picks the fastest available
    and logs why), causal (decoder) or bidirectional within each sequence, softmax scale, and the
    context-parallel K/V exchange."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        check_head_sizes(dim=self.dim, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads)
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise TypeError(f"tie_embeddings must be a bool, got {self.tie_embeddings!r}")
        if not isinstance(self.attention, AttentionConfig):
            raise TypeError(
                f"attention must be a thdpack.attention.AttentionConfig, got {type(self.attention).__name__}; "
                "e.g. attention=AttentionConfig(backend='math', causal=False)"
            )

    @property
    def head_dim(self) -> int:
        """H, channels per attention head."""
        return self.dim // self.n_heads

    @classmethod
    def preset(cls, name: ModelPreset, **overrides: Any) -> ModelConfig:
        """A named configuration with some fields replaced.

        ``"tiny"``: vocab 64, dim 32, 2 layers, 4 heads / 2 KV heads, ffn 64 (tests, ``thdpack
        verify``; too small a vocabulary for the GPT-2 tokenizer). ``"small"``: the defaults, the
        CPU training model (6.8M parameters). ``"114m"``: dim 768, 12 layers, 12 heads / 4 KV heads,
        ffn 2048 (114M parameters, a GPU node). The attention fields' old names ``attention_backend``,
        ``causal`` and ``cp_comm_type`` are accepted as overrides of ``attention``.

        >>> ModelConfig.preset("tiny", n_layers=1, causal=False).attention.causal
        False
        >>> ModelConfig.preset("huge")
        Traceback (most recent call last):
        ...
        ValueError: unknown model preset 'huge'; valid: 'tiny', 'small', '114m'
        """
        if name not in MODEL_PRESETS:
            valid = ", ".join(repr(p) for p in MODEL_PRESETS)
            raise ValueError(f"unknown model preset {name!r}; valid: {valid}")
        old_names = {key: overrides.pop(key) for key in list(overrides) if key in _OLD_ATTENTION_FIELDS}
        if old_names:
            if "attention" in overrides:
                raise TypeError(
                    f"got both attention and {sorted(old_names)}; set them inside attention=AttentionConfig(...)"
                )
            overrides["attention"] = AttentionConfig(**{_OLD_ATTENTION_FIELDS[k]: v for k, v in old_names.items()})
        return cls(**{**_PRESETS[name], **overrides})


def check_head_sizes(*, dim: int | None, n_heads: int, n_kv_heads: int, prefix: str = "") -> None:
    """``ValueError`` naming the fields (``prefix``: ``"model."`` for the Hydra group) unless the
    heads fit: ``dim`` a multiple of ``n_heads`` with an even head dim ``dim // n_heads`` (RoPE
    rotates pairs of channels), ``n_heads`` a multiple of ``n_kv_heads``. ``dim=None``: the head
    dim is set apart (Gemma's ``head_dim``), only the KV rule applies.

    >>> check_head_sizes(dim=36, n_heads=4, n_kv_heads=2, prefix="model.")
    Traceback (most recent call last):
    ...
    ValueError: head dim model.dim // model.n_heads = 9 is odd; ... (with model.dim=36: model.n_heads=1, 2, 3 or 6)
    """
    fits = [] if dim is None else [n for n in range(1, dim + 1) if dim % n == 0 and (dim // n) % 2 == 0]
    near = sorted(sorted(fits, key=lambda n: (abs(n - n_heads), n))[:4])  # the head counts nearest n_heads
    listed = f"{', '.join(map(str, near[:-1]))} or {near[-1]}" if len(near) > 1 else "".join(map(str, near))
    choice = f" (with {prefix}dim={dim}: {prefix}n_heads={listed})" if near else ""
    if dim is not None and dim % n_heads:
        raise ValueError(
            f"{prefix}dim={dim} is not a multiple of {prefix}n_heads={n_heads}; pick n_heads that divides dim{choice}"
        )
    if dim is not None and (dim // n_heads) % 2:
        raise ValueError(
            f"head dim {prefix}dim // {prefix}n_heads = {dim // n_heads} is odd; RoPE rotates pairs of channels, so "
            f"use an even head dim{choice}"
        )
    if n_heads % n_kv_heads:
        kv = [n for n in range(1, n_heads + 1) if n_heads % n == 0]
        raise ValueError(
            f"{prefix}n_heads={n_heads} is not a multiple of {prefix}n_kv_heads={n_kv_heads}; grouped-query "
            f"attention shares each KV head between n_heads // n_kv_heads query heads ({prefix}n_kv_heads: one of "
            f"{kv})"
        )


_PRESETS: dict[ModelPreset, dict[str, Any]] = {
    "tiny": {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64},
    "small": {},
    "114m": {"dim": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4, "ffn_dim": 2048},
}
_OLD_ATTENTION_FIELDS = {"attention_backend": "backend", "causal": "causal", "cp_comm_type": "cp_comm_type"}
"""ModelConfig's former attention fields -> the AttentionConfig field each one set."""
