"""thdpack: pack variable-length sequences into Transformer Engine's THD layout.

plan -> pack -> collate -> to_thd -> cp.shard -> attention / loss, each exact.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__: list[str] = ["__version__"]
