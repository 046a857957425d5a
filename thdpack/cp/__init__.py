"""Context parallelism over the THD layout (Transformer Engine's load-balanced chunking)."""

from __future__ import annotations

from thdpack.cp.allgather import allgather_attention
from thdpack.cp.partition import gather, partition_indices, shard, unshard
from thdpack.cp.ring import ring_attention
from thdpack.cp.simulate import simulated_ring_attention

__all__ = [
    "allgather_attention",
    "gather",
    "partition_indices",
    "ring_attention",
    "shard",
    "simulated_ring_attention",
    "unshard",
]
