"""The Hugging Face folder of a ``model=hf`` run: written into checkpoints, published at the end.

Each checkpoint that carries one (every one with ``train.save_hf=true``, else the last) holds
``hf/``, a ``save_pretrained`` folder (``thdpack.models.hf_causal_lm.save_hf_folder``) written
before the checkpoint's checksums are taken, so it is verified and pruned with the checkpoint. At
the end of the run the last one is copied to ``output_dir/hf`` (``publish_hf_folder``), where
``transformers.AutoModelForCausalLM.from_pretrained`` loads it with transformers' own attention.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from thdpack.data.tokenizer import SHIPPED_TOKENIZERS
from thdpack.files.publish import replace_folder
from thdpack.models.hf_causal_lm import save_hf_folder

HF_FOLDER = "hf"
"""A ``model=hf`` checkpoint's Hugging Face folder (``save_pretrained``), and the run's final copy."""


def checkpoint_export(model: torch.nn.Module, inner: torch.nn.Module, tokenizer: str) -> Callable[[Path], None]:
    """The checkpoint's Hugging Face folder writer, ``export(checkpoint_folder)`` (collective: FSDP2
    gathers the full weights; rank 0 writes). ``model`` is the wrapped model, ``inner`` its
    ``HFCausalLM``, ``tokenizer`` the run's ``data.tokenizer``."""

    def export(folder: Path) -> None:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            weights = {name.removeprefix("hf."): tensor for name, tensor in state.items()}
            save_hf_folder(inner, folder / HF_FOLDER, state_dict=weights, tokenizer=tokenizer_to_copy(tokenizer))

    return export


def tokenizer_to_copy(tokenizer: str) -> str | None:
    """A user's tokenizer folder / tokenizer.json to copy into the HF folder; None for a shipped
    one, which takes precedence over a path of the same name as in ``load_tokenizer``."""
    if tokenizer in SHIPPED_TOKENIZERS:
        return None
    return tokenizer if Path(tokenizer).expanduser().exists() else None


def publish_hf_folder(checkpoint: Path, output_dir: Path) -> Path:
    """Copy ``checkpoint``'s HF folder to ``output_dir/hf``: a folder swapped in whole
    (``thdpack.files.publish.replace_folder``), since ``from_pretrained`` reads no manifest."""
    return replace_folder(checkpoint / HF_FOLDER, output_dir / HF_FOLDER)
