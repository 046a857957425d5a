"""Exact attention over THD batches: one call, several backends, context parallelism.

``thd_attention(q, k, v, thd, ...)`` attends every packed sequence to itself only, on one device
or across a context-parallel group (TE's load-balanced layout), with the backend chosen
automatically or forced. The CP algorithms are also callable directly: ``ring_attention`` (P2P),
``allgather_attention``, ``a2a_attention`` (all-to-all, DeepSpeed Ulysses) and
``simulated_ring_attention`` (a whole ring in one process).
``reference_attention`` is the per-sequence dense oracle everything is tested against.
"""

from __future__ import annotations

from thdpack.attention.a2a import a2a_attention
from thdpack.attention.allgather import allgather_attention
from thdpack.attention.api import thd_attention
from thdpack.attention.config import BACKENDS, CP_COMM_TYPES, AttentionConfig, Backend, CpCommType
from thdpack.attention.reference import reference_attention
from thdpack.attention.ring import ring_attention
from thdpack.attention.ring_simulation import simulated_ring_attention

__all__ = [
    "BACKENDS",
    "CP_COMM_TYPES",
    "AttentionConfig",
    "Backend",
    "CpCommType",
    "a2a_attention",
    "allgather_attention",
    "reference_attention",
    "ring_attention",
    "simulated_ring_attention",
    "thd_attention",
]
