"""Packs: the pack layout (CP padding, positions, labels), packs built from samples and plans, the
dealer (epochs, data-parallel shares, balanced steps) and the map-style (``PackedDataset``) and
streaming (``StreamingPacker``) datasets that serve them, built with the run's ``PackingRuntime``."""

from __future__ import annotations

from thdpack.packing.dataset import PackedDataset, PackedDatasetConfig
from thdpack.packing.packer import Pack, build_pack
from thdpack.packing.runtime import PackingRuntime
from thdpack.packing.step_stream import StepStream
from thdpack.packing.streaming import StreamingPacker, StreamingPackerConfig

__all__ = [
    "Pack",
    "PackedDataset",
    "PackedDatasetConfig",
    "PackingRuntime",
    "StepStream",
    "StreamingPacker",
    "StreamingPackerConfig",
    "build_pack",
]
