"""thdpack: pack variable-length sequences into Transformer Engine's THD layout, exactly.

plan -> pack -> collate -> to_thd -> cp.shard -> attention / loss:

>>> import thdpack
>>> plan = thdpack.plan_packs([5, 3, 6, 2, 4], pack_size=10)
>>> [p.tolist() for p in plan]
[[2, 4], [0, 1, 3]]

Names are imported on first use (``__getattr__`` below, a plain lookup of the module that
defines each name), so ``import thdpack`` (and the numpy-only ``thdpack.plan``) stays light;
torch loads with the first tensor-facing name.
"""

from __future__ import annotations

import importlib
from typing import Any

from thdpack._version import __version__

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
    "PlanConfig": "thdpack.plan",
    # the THD format's rules (numpy only)
    "IGNORE_INDEX": "thdpack.layout.rules",
    # packs
    "build_pack": "thdpack.packing",
    "Pack": "thdpack.packing",
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
    "hf_packed_kwargs": "thdpack.models.hf.attention",
    "register_hf_attention": "thdpack.models.hf.attention",
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
    "models",
    "packing",
    "plan",
    "thd",
    "train",
    "verify",
)

__all__ = ["__version__", *sorted(_EXPORTS), *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"thdpack.{name}")
    else:
        raise AttributeError(f"module 'thdpack' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
