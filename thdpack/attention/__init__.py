"""Exact attention over THD batches: one call, several backends, context parallelism.

``thd_attention(q, k, v, thd, ...)`` attends every packed sequence to itself only, on one device
or across a context-parallel group (TE's load-balanced layout), with the backend chosen
automatically or forced. ``reference_attention`` is the per-sequence dense oracle it is tested
against.
"""

from __future__ import annotations

from thdpack.attention.api import thd_attention
from thdpack.attention.config import BACKENDS, CP_COMM_TYPES, AttentionConfig, Backend, CpCommType
from thdpack.attention.reference import reference_attention

__all__ = [
    "BACKENDS",
    "CP_COMM_TYPES",
    "AttentionConfig",
    "Backend",
    "CpCommType",
    "reference_attention",
    "thd_attention",
]
