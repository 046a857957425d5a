"""thdpack's reference decoder over THD batches, and the Hugging Face adapter.

``Transformer(ModelConfig(...))`` runs packed, CP-sharded THD batches exactly (the same logits
and gradients as each sequence alone); :mod:`thdpack.models.hf` runs THD batches through Hugging Face
models, on thdpack's attention.
"""

from __future__ import annotations

from thdpack.models.config import MODEL_PRESETS, ModelConfig
from thdpack.models.transformer import Transformer

__all__ = ["MODEL_PRESETS", "ModelConfig", "Transformer"]
