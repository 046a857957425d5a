"""THD batches: collate packs into a BSHD batch, flatten it to Transformer Engine's THD layout.

``format`` holds the formats (keys, dtypes, the -1000 sentinel) and their validation; ``batch``
the functions that build batches (``collate``, ``to_thd``, ``thd_collate``,
``split_micro_batches``, ``thd_to_device``, ``thd_pin_memory``).
"""

from __future__ import annotations

from thdpack.thd.batch import collate, split_micro_batches, thd_collate, thd_to_device, to_thd
from thdpack.thd.format import SEQ_LENS_SENTINEL, THDBatch, validate_thd

__all__ = [
    "SEQ_LENS_SENTINEL",
    "THDBatch",
    "collate",
    "split_micro_batches",
    "thd_collate",
    "thd_to_device",
    "to_thd",
    "validate_thd",
]
