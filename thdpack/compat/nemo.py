"""Drop-in replacements for NeMo AutoModel's packing, THD and TE context-parallel functions.

Switch imports and keep the call sites::

    # from nemo_automodel.components.datasets.llm.packed_sequence import pack_dataset
    # from nemo_automodel.components.distributed.cp_utils import make_cp_batch_for_te
    from thdpack.compat.nemo import pack_dataset, make_cp_batch_for_te

Signatures and outputs follow NeMo AutoModel's current generation (v0.5 and main): the same
packs, the same collated batches, ``cu_seqlens`` from real lengths with trailing-pad
absorption, ``padding_mask`` from the pack layout, and Transformer Engine's CP partition
(computed by ``thdpack.cp.partition_indices``, so no TE install is needed). Where NeMo
silently corrupts data thdpack raises a ``ValueError`` that names the problem instead: a pack
size that is not a multiple of ``2*cp_size``, a batch that does not split evenly into chunks,
sequence lengths that do not match the rows, and a missing ``seq_lens`` (NeMo then guesses
padding from token values). Long samples that ``drop_long_samples=True`` skips are logged as a
WARNING with their count. Each function's docstring lists its differences.
"""

from __future__ import annotations

from thdpack.compat._nemo_packing import (
    SEQ_LENS_SENTINEL,
    create_block_causal_mask,
    pack_dataset,
    packed_block_causal_mask,
    packed_sequence_thd_collater,
)
from thdpack.compat._nemo_thd import make_cp_batch_for_te, process_input_for_thd, split_batch_into_thd_chunks

CROSS_ENTROPY_IGNORE_IDX = -100

__all__ = [
    "CROSS_ENTROPY_IGNORE_IDX",
    "SEQ_LENS_SENTINEL",
    "create_block_causal_mask",
    "make_cp_batch_for_te",
    "pack_dataset",
    "packed_block_causal_mask",
    "packed_sequence_thd_collater",
    "process_input_for_thd",
    "split_batch_into_thd_chunks",
]
