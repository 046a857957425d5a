"""Context parallelism over the THD layout (Transformer Engine's load-balanced chunking)."""

from __future__ import annotations

from thdpack.cp.partition import partition_indices

__all__ = ["partition_indices"]
