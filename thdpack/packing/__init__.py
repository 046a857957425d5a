"""Packs: the pack layout (CP padding, positions, labels), packs built from samples and plans, the
dealer (epochs, data-parallel shares, balanced steps) and the map-style (``PackedDataset``) and
streaming (``StreamingPacker``) datasets that serve them, built with the run's ``PackingRuntime``."""

from __future__ import annotations

from thdpack.packing.dataset import PackedDataset, PackedDatasetConfig
from thdpack.packing.dealing import Epochs, EpochShard
from thdpack.packing.packer import Pack, SampleTokens, assemble_pack, build_pack, pack_from_segments, read_sample
from thdpack.packing.runtime import PackingRuntime
from thdpack.packing.step_stream import Step, StepStream
from thdpack.packing.streaming import StreamingPacker, StreamingPackerConfig

__all__ = [
    "EpochShard",
    "Epochs",
    "Pack",
    "PackedDataset",
    "PackedDatasetConfig",
    "PackingRuntime",
    "SampleTokens",
    "Step",
    "StepStream",
    "StreamingPacker",
    "StreamingPackerConfig",
    "assemble_pack",
    "build_pack",
    "pack_from_segments",
    "read_sample",
]
