"""Hugging Face ``transformers`` models over THD batches (transformers is imported at the point of
use: ``thdpack[hf]``).

- :mod:`.attention`: ``hf_packed_kwargs`` (the keyword arguments that run a packed row or a CP
  shard through a transformers model), ``register_hf_attention`` (thdpack's attention as an
  ``attn_implementation``) and ``check_hf_attention`` (what CP requires of the model);
- :mod:`.causal_lm`: ``HFCausalLM``, a causal LM behind thdpack's model interface (the trainer's
  ``model=hf``), built from ``HFModelConfig``, and ``save_hf_folder``;
- :mod:`.folder`: a local model folder, loaded with every mismatch named (what ``build_hf_model``
  does with ``HFModelConfig.path``).
"""

from __future__ import annotations

from thdpack.models.hf.attention import check_hf_attention, hf_packed_kwargs, register_hf_attention
from thdpack.models.hf.causal_lm import HFCausalLM, HFModelConfig, build_hf_model, save_hf_folder

__all__ = [
    "HFCausalLM",
    "HFModelConfig",
    "build_hf_model",
    "check_hf_attention",
    "hf_packed_kwargs",
    "register_hf_attention",
    "save_hf_folder",
]
