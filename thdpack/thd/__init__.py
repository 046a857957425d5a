"""THD batches: collate packs into a BSHD batch, flatten it to Transformer Engine's THD layout.

``format`` holds the formats (keys, dtypes, the -1000 sentinel) and their validation; ``batch``
the functions that build batches (``collate``, ``to_thd``, ``thd_collate``,
``split_micro_batches``, ``thd_to_device``, ``thd_pin_memory``).
"""

from __future__ import annotations

from thdpack.thd.batch import (
    collate,
    sequence_lengths,
    split_micro_batches,
    thd_collate,
    thd_pin_memory,
    thd_to_device,
    to_thd,
)
from thdpack.thd.format import PACK_KEYS, SEQ_LENS_SENTINEL, THD_METADATA_KEYS, THDBatch, validate_thd

__all__ = [
    "PACK_KEYS",
    "SEQ_LENS_SENTINEL",
    "THD_METADATA_KEYS",
    "THDBatch",
    "collate",
    "sequence_lengths",
    "split_micro_batches",
    "thd_collate",
    "thd_pin_memory",
    "thd_to_device",
    "to_thd",
    "validate_thd",
]
