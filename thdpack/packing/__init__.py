"""Packs: the pack layout (CP padding, positions, labels), packs built from samples, and the
map-style (``PackedDataset``) and streaming (``StreamingPacker``) datasets that serve them."""

from __future__ import annotations

from thdpack.packing.dataset import EpochShard, PackedDataset, PackedDatasetConfig
from thdpack.packing.layout import IGNORE_INDEX
from thdpack.packing.packer import Pack, SampleTokens, assemble_pack, build_pack, read_sample
from thdpack.packing.streaming import StreamingPacker, StreamingPackerConfig

__all__ = [
    "IGNORE_INDEX",
    "EpochShard",
    "Pack",
    "PackedDataset",
    "PackedDatasetConfig",
    "SampleTokens",
    "StreamingPacker",
    "StreamingPackerConfig",
    "assemble_pack",
    "build_pack",
    "read_sample",
]
