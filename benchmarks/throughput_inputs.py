"""What both throughput benchmarks train on: the lengths files, the models and the seed.

``train_throughput.py`` (layouts on one device) and ``cp_throughput.py`` (CP layouts on ``cp``
processes) both import this module, so the imports point one way: ``train_throughput.py --cp N``
runs ``cp_throughput.py``, which imports nothing of it.

Legend: ``S`` documents.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from thdpack.models import ModelConfig  # noqa: E402
from thdpack.plan.overflow import apply_overflow  # noqa: E402

SEED = 1234
SHARED = Path(os.environ.get("THDPACK_SHARED_DATA", ROOT.parent / "shared" / "data"))
DATASETS = {
    "alpaca": SHARED / "alpaca_data.gpt2.lengths.npy",
    "stdlib": ROOT / "thdpack" / "assets" / "examples" / "python311_stdlib.gpt2.lengths.npy",
}
"""Default lengths files: Alpaca (in ../shared/data, only beside the project's own checkout) and
the standard library corpus shipped in thdpack/assets."""

TINY_MODEL = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192)
"""The ``--tiny`` runs' model: seconds on a CPU."""
CPU_MODEL = ModelConfig(vocab_size=8192, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=768)
"""5.2M parameters (2.1M of them the tied embedding of a 8,192-word vocabulary): big enough that
the layers, not the LM head alone, set the step time, small enough for a 2-core CPU."""


def load_lengths(path: Path) -> tuple[np.ndarray, int]:
    """``(lengths_S, empty)``: (S,) int64 document lengths from a 1-D integer .npy file, without the
    ``empty`` zero-length documents (records that tokenized to nothing: no tokens, no work)."""
    lengths = np.load(path, allow_pickle=False)
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu":
        raise ValueError(
            f"{path}: expected a 1-D integer array of document lengths, got {lengths.dtype} {lengths.shape}"
        )
    if (lengths < 0).any():
        i = int(np.argmax(lengths < 0))
        raise ValueError(f"{path}: document {i} has length {int(lengths[i])}; lengths must be >= 0")
    keep = lengths > 0
    if not keep.any():
        raise ValueError(f"{path}: every one of its {len(lengths)} documents is empty; nothing to train on")
    return lengths[keep].astype(np.int64), int((~keep).sum())


def split_documents(lengths_S: np.ndarray, pack_size: int) -> tuple[np.ndarray, int]:
    """``(pieces, split)``: documents longer than ``pack_size`` cut into pack-size pieces (the
    planner's ``overflow="split"`` rule), and how many documents were cut."""
    entries = apply_overflow(lengths_S, pack_size, "split")
    return entries.length.astype(np.int64), entries.split_sequences
