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
sequence lengths that do not match the rows, a missing ``seq_lens`` (NeMo then guesses
padding from token values), and a collater item whose ``attention_mask`` is not one run of
tokens; a left-padded item, whose pad tokens NeMo takes for the sequence, is honoured (its real
tokens lead its row). Where NeMo itself raises, the error is also of NeMo's class, so a
caller's ``except`` still catches it: ``NemoKeyError`` (``ValueError`` and ``KeyError``) for a
batch without ``seq_lens``, ``NemoRuntimeError`` (``ValueError`` and ``RuntimeError``) for packs
of different lengths in the collater. Long samples that ``drop_long_samples=True`` skips are
logged as a WARNING with their count. Each function's docstring lists its differences.

Each drop-in is a thdpack core call plus NeMo's names and quirks: ``pack_dataset`` is
``plan_packs(algorithm="sequential", overflow="drop" | "error")`` + ``assemble_pack``,
``packed_sequence_thd_collater`` is ``thdpack.collate``, ``process_input_for_thd`` is
``thdpack.to_thd`` (which checks the lengths and takes ``padding_mask`` from the layout),
``split_batch_into_thd_chunks`` is ``thdpack.thd.split_micro_batches`` and ``process_input_for_thd``
per chunk, ``make_cp_batch_for_te`` shards with ``thdpack.cp.shard``, and
``create_block_causal_mask`` is ``thdpack.attention.masks.block_causal_mask``. A fix in the core
fixes the drop-in. Their outputs have NeMo's keys exactly (no ``thd_meta`` record): thdpack's
attention validates such a batch once, on first use.

``padding_token_id`` (``process_input_for_thd``, ``split_batch_into_thd_chunks``,
``make_cp_batch_for_te``) is accepted for NeMo's signatures and not used: NeMo reads padding
from token values equal to it, which masks real tokens whenever the pad id also occurs as
content (an EOS used as pad); thdpack reads padding from the pack layout (``seq_lens`` /
``seq_lens_padded``) only.
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
