"""thdpack: pack variable-length sequences into Transformer Engine's THD layout, exactly.

plan -> pack -> collate -> to_thd -> cp.shard -> attention / loss:

>>> import thdpack
>>> plan = thdpack.plan_packs([5, 3, 6, 2, 4], pack_size=10)
>>> [p.tolist() for p in plan]
[[2, 4], [0, 1, 3]]

The front door holds the names of that path; everything else lives in its stage's package
(``thdpack.plan``, ``thdpack.packing``, ``thdpack.thd``, ``thdpack.cp``, ``thdpack.attention``,
``thdpack.models``, ``thdpack.data``, ...), documented there. The planning names import with
numpy alone; the names that need torch are imported on first use (``__getattr__``), so
``import thdpack`` never loads torch. Subpackages load on first attribute access too
(``thdpack.cp.shard``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from thdpack._version import __version__
from thdpack.layout.rules import IGNORE_INDEX
from thdpack.plan.api import plan_packs
from thdpack.plan.config import PlanConfig
from thdpack.plan.packing_stats import PackingStats
from thdpack.plan.packplan import PackPlan

if TYPE_CHECKING:  # what static tools read; at run time __getattr__ imports each on first use
    from thdpack.attention.api import thd_attention
    from thdpack.data.store import TokenStore
    from thdpack.data.store_verify import verify_store
    from thdpack.loss import StepLoss, packed_cross_entropy
    from thdpack.packing.dataset import PackedDataset
    from thdpack.packing.streaming import StreamingPacker
    from thdpack.thd.batch import collate, thd_collate, to_thd

# name -> the module that defines it (these import torch, or more than numpy)
_LAZY = {
    "PackedDataset": "thdpack.packing.dataset",
    "StreamingPacker": "thdpack.packing.streaming",
    "collate": "thdpack.thd.batch",
    "to_thd": "thdpack.thd.batch",
    "thd_collate": "thdpack.thd.batch",
    "thd_attention": "thdpack.attention.api",
    "StepLoss": "thdpack.loss",
    "packed_cross_entropy": "thdpack.loss",
    "TokenStore": "thdpack.data.store",
    "verify_store": "thdpack.data.store_verify",
}
# thdpack.cp.shard(...) after a bare `import thdpack`, as for any attribute
_SUBPACKAGES = (
    "attention",
    "compat",
    "cp",
    "data",
    "files",
    "integrations",
    "layout",
    "models",
    "packing",
    "perf",
    "plan",
    "thd",
    "train",
    "verify",
)

__all__ = [
    "IGNORE_INDEX",
    "PackPlan",
    "PackedDataset",
    "PackingStats",
    "PlanConfig",
    "StepLoss",
    "StreamingPacker",
    "TokenStore",
    "__version__",
    "collate",
    "packed_cross_entropy",
    "plan_packs",
    "thd_attention",
    "thd_collate",
    "to_thd",
    "verify_store",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"thdpack.{name}")
    else:
        raise AttributeError(f"module 'thdpack' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, *_SUBPACKAGES})
