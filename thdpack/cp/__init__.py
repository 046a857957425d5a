"""Context parallelism over the THD layout (Transformer Engine's load-balanced chunking)."""

from __future__ import annotations

from thdpack.cp.partition import gather, partition_indices, shard, unshard

__all__ = ["gather", "partition_indices", "shard", "unshard"]
