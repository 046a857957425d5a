"""thdpack: pack variable-length sequences into Transformer Engine's THD layout, exactly.

plan -> pack -> collate -> to_thd -> cp.shard -> attention / loss:

>>> import thdpack
>>> plan = thdpack.plan_packs([5, 3, 6, 2, 4], pack_size=10)
>>> [p.tolist() for p in plan]
[[2, 4], [0, 1, 3]]

Names are imported on first use, so ``import thdpack`` (and the numpy-only ``thdpack.plan``)
stays light; torch loads with the first tensor-facing name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    # planning (numpy only)
    "plan_packs": "thdpack.plan",
    "PackPlan": "thdpack.plan",
    "PackingStats": "thdpack.plan",
    "ALGORITHMS": "thdpack.plan",
    "OVERFLOWS": "thdpack.plan",
    "l2_lower_bound": "thdpack.plan",
    "plan_histogram": "thdpack.plan",
    "HistogramPlan": "thdpack.plan",
    # packs
    "build_pack": "thdpack.packing",
    "Pack": "thdpack.packing",
    "IGNORE_INDEX": "thdpack.packing",
    "PackedDataset": "thdpack.packing",
    "PackedDatasetConfig": "thdpack.packing",
    "StreamingPacker": "thdpack.packing",
    "StreamingPackerConfig": "thdpack.packing",
    # THD batches
    "collate": "thdpack.thd",
    "to_thd": "thdpack.thd",
    "thd_collate": "thdpack.thd",
    "thd_to_device": "thdpack.thd",
    "split_micro_batches": "thdpack.thd",
    "validate_thd": "thdpack.thd",
    "SEQ_LENS_SENTINEL": "thdpack.thd",
    # masks (for attention kernels that take a mask)
    "block_causal_mask": "thdpack.attention.masks",
    "block_causal_bias": "thdpack.attention.masks",
    "flex_block_mask": "thdpack.attention.masks",
    # attention
    "thd_attention": "thdpack.attention",
    "AttentionConfig": "thdpack.attention",
    "reference_attention": "thdpack.attention",
    # loss
    "packed_cross_entropy": "thdpack.loss",
    "count_loss_tokens": "thdpack.loss",
    "loss_weights": "thdpack.loss",
    "StepLoss": "thdpack.loss",
    # models
    "ModelConfig": "thdpack.models",
    "Transformer": "thdpack.models",
    "hf_packed_kwargs": "thdpack.models.hf_attention",
    "register_hf_attention": "thdpack.models.hf_attention",
    # data
    "TokenStore": "thdpack.data.store",
    "TokenStoreWriter": "thdpack.data.store",
    "StoreError": "thdpack.data.manifest",
    "verify_store": "thdpack.data.store_verify",
    "load_tokenizer": "thdpack.data.tokenizer",
    "SampleEncoder": "thdpack.data.encode",
}
# modules reachable as attributes: thdpack.cp.shard(...), thdpack.compat.nemo...
_SUBMODULES = (
    "attention",
    "compat",
    "cp",
    "data",
    "integrations",
    "layout",
    "models",
    "packing",
    "plan",
    "thd",
    "train",
    "verify",
)

# Names that were public before the package was split by pipeline stage, still reachable:
# old module paths (``import thdpack.packer``) and internals that left the top level.
_MOVED_MODULES = {
    "thdpack.layout": "thdpack.packing.layout",
    "thdpack.packer": "thdpack.packing.packer",
    "thdpack.packed_dataset": "thdpack.packing.dataset",
    "thdpack.streaming": "thdpack.packing.streaming",
    "thdpack.thd_format": "thdpack.thd.format",
    "thdpack.masks": "thdpack.attention.masks",
    "thdpack.report": "thdpack.data.stats_command",
    "thdpack.models.exactness": "thdpack.verify.exactness",
    "thdpack.cp.ring": "thdpack.attention.ring",
    "thdpack.cp.allgather": "thdpack.attention.allgather",
    "thdpack.cp.simulate": "thdpack.attention.ring_simulation",
}
_MOVED_NAMES = {
    "assemble_pack": "thdpack.packing.packer",
    "read_sample": "thdpack.packing.packer",
    "TokenLayout": "thdpack.attention.masks",
    "token_layout": "thdpack.attention.masks",
    "layout_mask": "thdpack.attention.masks",
    "segment_ids": "thdpack.attention.masks",
}

__all__ = ["__version__", *sorted(_EXPORTS), *_SUBMODULES]


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Resolves a pre-split module path (``thdpack.packer``) to the module that replaced it."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedModuleLoader(_MOVED_MODULES[fullname]))


class _MovedModuleLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """The target module is already executed."""


sys.meta_path.append(_MovedModuleFinder())


def __getattr__(name: str) -> Any:
    if name in _EXPORTS or name in _MOVED_NAMES:
        value = getattr(importlib.import_module(_EXPORTS.get(name) or _MOVED_NAMES[name]), name)
    elif name == "layout":  # the pack layout's old home
        value = importlib.import_module("thdpack.packing.layout")
    elif name in _SUBMODULES:
        value = importlib.import_module(f"thdpack.{name}")
    else:
        raise AttributeError(f"module 'thdpack' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
