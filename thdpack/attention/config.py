"""Settings of THD attention: the closed set of backends and CP communication types.

>>> AttentionConfig(backend="math", causal=False)
AttentionConfig(backend='math', causal=False, softmax_scale=None, cp_comm_type='p2p')
>>> AttentionConfig(backend="fast")
Traceback (most recent call last):
...
ValueError: unknown attention backend 'fast'; valid: 'auto', 'te', 'flash', 'varlen', 'flex', 'sdpa', 'math'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Backend = Literal["auto", "te", "flash", "varlen", "flex", "sdpa", "math"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)
CpCommType = Literal["p2p", "all_gather", "a2a"]
CP_COMM_TYPES: tuple[CpCommType, ...] = get_args(CpCommType)


def resolve_softmax_scale(softmax_scale: float | None, head_dim: int) -> float:
    """The scale scores are multiplied by: ``softmax_scale``, or ``head_dim ** -0.5`` when it is None.

    >>> resolve_softmax_scale(None, 64), resolve_softmax_scale(0.5, 64)
    (0.125, 0.5)
    """
    return head_dim**-0.5 if softmax_scale is None else softmax_scale


def _listing(options: tuple[str, ...]) -> str:
    return ", ".join(repr(o) for o in options)


def check_backend(backend: str, source: str = "attention backend") -> Backend:
    """``backend`` if it is one of :data:`BACKENDS`, else ``ValueError`` listing them."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown {source} {backend!r}; valid: {_listing(BACKENDS)}")
    return backend  # type: ignore[return-value]


@dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """How :func:`thdpack.attention.thd_attention` computes attention: its ``config`` argument and
    ``ModelConfig.attention`` (Hydra: the ``attention`` group, which the trainer puts into the model)."""

    backend: Backend = "auto"
    """Kernel family; ``"auto"`` picks the fastest available one and logs why (also settable with
    the environment variable ``THDPACK_ATTENTION_BACKEND``)."""
    causal: bool = True
    """Causal (decoder) attention inside each sequence; False = each sequence fully visible."""
    softmax_scale: float | None = None
    """Score scale; None = ``head_dim ** -0.5`` (:func:`resolve_softmax_scale`)."""
    cp_comm_type: CpCommType = "p2p"
    """Context-parallel exchange: ``"p2p"`` ring of K/V, ``"all_gather"`` of K/V (Llama 3 style), or
    ``"a2a"`` (DeepSpeed Ulysses: all-to-alls turn the shard's Q/K/V into whole sequences for
    ``Nq / cp`` heads, attended by the backend's local kernel; cp must divide ``Nq``;
    :mod:`thdpack.attention.a2a`)."""

    def __post_init__(self) -> None:
        check_backend(self.backend)
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"unknown cp_comm_type {self.cp_comm_type!r}; valid: {_listing(CP_COMM_TYPES)}")
        if self.softmax_scale is not None and not self.softmax_scale > 0:
            raise ValueError(f"softmax_scale must be > 0 (or None for head_dim ** -0.5), got {self.softmax_scale}")
