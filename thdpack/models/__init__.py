"""thdpack's reference decoder over THD batches, and the Hugging Face adapter.

``Transformer(ModelConfig(...))`` runs packed, CP-sharded THD batches exactly (the same logits
and gradients as each sequence alone); ``thdpack.models.hf_attention`` feeds THD batches to Hugging Face
models and registers thdpack's attention with them.
"""

from __future__ import annotations

from thdpack.models.config import MODEL_PRESETS, ModelConfig, ModelPreset
from thdpack.models.transformer import Transformer

__all__ = ["MODEL_PRESETS", "ModelConfig", "ModelPreset", "Transformer"]
