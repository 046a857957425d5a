"""Context parallelism's data layout: Transformer Engine's load-balanced partition of a THD batch
(or a per-sequence placement's layout), and the collectives that move its shards.

``partition_indices`` (TE's ``thd_get_partitioned_indices``), ``shard`` / ``unshard`` / ``gather``
of THD batches, ``rank_token_indices`` (a rank's global token indices, under either layout),
``CpTopology`` (this process's place in dp x cp, with its process groups: ``topology``), and the
ring / row communication (``comm``) that the CP attention algorithms in ``thdpack.attention``
(ring, all-gather) use.
"""

from __future__ import annotations

from thdpack.cp.partition import gather, partition_indices, shard, unshard
from thdpack.cp.topology import CpTopology

__all__ = ["CpTopology", "gather", "partition_indices", "shard", "unshard"]
