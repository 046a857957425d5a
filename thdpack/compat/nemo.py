"""Drop-in replacements for NeMo AutoModel's packing, THD and TE context-parallel functions.

Switch the imports and keep the call sites; the outputs are NeMo's, and where NeMo silently
corrupts data a ``ValueError`` names the problem instead (docs/guides/nemo.md). Each drop-in is
a thdpack core call plus NeMo's names, so a fix in the core fixes the drop-in.
"""

from __future__ import annotations

from thdpack.compat._nemo_errors import NemoKeyError, NemoRuntimeError
from thdpack.compat._nemo_packing import (
    SEQ_LENS_SENTINEL,
    create_block_causal_mask,
    pack_dataset,
    packed_block_causal_mask,
    packed_sequence_thd_collater,
)
from thdpack.compat._nemo_thd import make_cp_batch_for_te, process_input_for_thd, split_batch_into_thd_chunks
from thdpack.layout.rules import IGNORE_INDEX

CROSS_ENTROPY_IGNORE_IDX = IGNORE_INDEX

__all__ = [
    "CROSS_ENTROPY_IGNORE_IDX",
    "SEQ_LENS_SENTINEL",
    "NemoKeyError",
    "NemoRuntimeError",
    "create_block_causal_mask",
    "make_cp_batch_for_te",
    "pack_dataset",
    "packed_block_causal_mask",
    "packed_sequence_thd_collater",
    "process_input_for_thd",
    "split_batch_into_thd_chunks",
]
