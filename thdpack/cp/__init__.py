"""Context parallelism's data layout: Transformer Engine's load-balanced partition of a THD batch,
and the collectives that move its shards.

``partition_indices`` (TE's ``thd_get_partitioned_indices``), ``shard`` / ``unshard`` / ``gather``
of THD batches, and the ring / row communication (``comm``) that the CP attention algorithms in
``thdpack.attention`` (ring, all-gather) use.
"""

from __future__ import annotations

from thdpack.cp.partition import gather, local_placement, partition_indices, shard, unshard

__all__ = ["gather", "local_placement", "partition_indices", "shard", "unshard"]

# CP attention lives with the other attention algorithms (thdpack.attention) since the package
# was split by pipeline stage; the old names resolve there, without an import cycle at load time.
_MOVED_TO_ATTENTION = {"allgather_attention", "ring_attention", "simulated_ring_attention"}


def __getattr__(name: str):
    if name in _MOVED_TO_ATTENTION:
        import importlib
        import warnings

        warnings.warn(
            f"thdpack.cp.{name} moved to thdpack.attention.{name}; the old name will be removed",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module("thdpack.attention"), name)
    raise AttributeError(f"module 'thdpack.cp' has no attribute {name!r}")
