"""TRL's ``SFTTrainer`` with thdpack's packing and context parallelism: change one import.

::

    from thdpack.integrations.trl import SFTTrainer     # instead of: from trl import SFTTrainer

    args = SFTConfig("out", max_length=8192, packing=True, assistant_only_loss=True,
                     parallelism_config=ParallelismConfig(cp_size=2))
    SFTTrainer(model=model, args=args, train_dataset=chats, processing_class=tokenizer).train()

TRL 1.16 refuses ``packing=True`` with ``cp_size > 1`` (huggingface/trl#6843): accelerate's CP
drops every layer's attention mask, so packed documents would attend to each other. This trainer
keeps TRL's preprocessing (chat templates, ``assistant_only_loss`` / ``completion_only_loss``
masks, EOS handling, its tokenization) to produce ``input_ids`` and ``labels``, and replaces what
comes after (TRL's packing, padding-free collator, accelerate's CP hook and TRL's loss) with
thdpack's: ``thdpack.integrations.transformers`` describes them. From the ``SFTConfig``:
``max_length`` is the pack size (TRL's meaning under packing), ``packing_strategy="bfd_split"``
splits sequences longer than a pack and ``"bfd"`` truncates them (counted in the packing stats);
``packing`` itself is not needed (the trainer always packs). ``packing=PackingArguments(...)``
overrides any of these, and sets what TRL has no setting for (among them ``cp_placement``:
``"adaptive"`` by default, short sequences whole on one CP rank).

Refused besides the Trainer integration's refusals: ``packing_strategy="wrapped"`` (it cuts
documents at pack boundaries and attends across them; use ``PackingArguments(algorithm="window")``
to keep the order), ``truncation_mode="keep_end"`` (thdpack truncates the end), ``loss_type="dft"``,
TRL's ``compute_loss_func`` and an MoE router auxiliary loss (the loss is thdpack's token mean),
vision datasets.

TRL internals this relies on (trl 1.16): ``SFTTrainer`` preparing ``train_dataset`` into
``input_ids`` / ``labels`` columns during ``__init__`` when ``packing=False`` and
``max_length=None``, and ``aux_loss_enabled``. TRL's chunked fused LM head is not used (its fp32
kernel would cap the exactness at fp32); the loss reads the model's logits of this rank's shard.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

from thdpack._optional import require
from thdpack.integrations.transformers import PackingArguments, ThdpackTrainerMixin, refuse_data_collator

trl = require("trl", "thdpack.integrations.trl")
SFTConfig = trl.SFTConfig

__all__ = ["PackingArguments", "SFTConfig", "SFTTrainer"]


class SFTTrainer(ThdpackTrainerMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` with thdpack's packing, CP and exact loss (module docstring).

    Takes ``trl.SFTTrainer``'s arguments (``args`` must be an ``SFTConfig``), plus ``packing``.
    """

    def __init__(self, *args: Any, packing: PackingArguments | None = None, **kwargs: Any) -> None:
        init = trl.SFTTrainer.__init__
        refuse_data_collator(init, args, kwargs)
        bound = _bind(init, args, kwargs)
        config = bound.get("args")
        if not isinstance(config, SFTConfig):
            raise TypeError(f"pass args=SFTConfig(...) (max_length is the pack size); got {type(config).__name__}")
        packing = packing or PackingArguments()
        pack_size = packing.pack_size or config.max_length
        if pack_size is None:
            raise ValueError("set SFTConfig(max_length=...) or PackingArguments(pack_size=...): the tokens per pack")
        overflow = packing.overflow or ("split" if config.packing_strategy == "bfd_split" else "truncate")
        _refuse(config, overflow)
        # TRL tokenizes and masks; thdpack packs: TRL's own packing, padding-free collator and
        # truncation are switched off on a copy of the user's config
        own = copy.copy(config)
        own.packing, own.eval_packing, own.padding_free, own.max_length = False, False, False, None
        bound["args"] = own
        super().__init__(**bound)
        if self.aux_loss_enabled:
            raise ValueError(
                "the model adds an MoE router auxiliary loss; thdpack's loss is the token-mean cross-entropy: set "
                "SFTConfig(router_aux_loss_coef=0.0)"
            )
        self._setup_packing(packing, pack_size=pack_size, overflow=overflow)


def _bind(init: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = inspect.signature(init).bind(None, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop("self")
    return arguments


def _refuse(config: Any, overflow: str) -> None:
    refusals = {
        "packing_strategy='wrapped' (it cuts documents at pack boundaries); use PackingArguments(algorithm="
        "'window') to keep the dataset's order": config.packing and config.packing_strategy == "wrapped",
        "truncation_mode='keep_end' (thdpack's overflow='truncate' keeps the start)": overflow == "truncate"
        and config.truncation_mode == "keep_end",
        "loss_type='dft': the loss is thdpack's token-mean cross-entropy": config.loss_type != "nll",
    }
    refused = [reason for reason, applies in refusals.items() if applies]
    if refused:
        raise ValueError(f"thdpack's SFTTrainer cannot train with {'; '.join(refused)}")
