"""TRL's ``SFTTrainer`` with thdpack's packing and context parallelism: change one import.

::

    from thdpack.integrations.trl import SFTTrainer     # instead of: from trl import SFTTrainer

    args = SFTConfig("out", max_length=8192, packing=True, assistant_only_loss=True,
                     parallelism_config=ParallelismConfig(cp_size=2))
    SFTTrainer(model=model, args=args, train_dataset=chats, processing_class=tokenizer).train()

TRL's preprocessing (chat templates, loss masks, EOS, tokenization) produces ``input_ids`` and
``labels``; thdpack replaces what comes after (packing, collator, CP, loss), as
``thdpack.integrations.transformers`` does. ``max_length`` is the pack size;
``packing_strategy="bfd_split"`` splits sequences longer than a pack and ``"bfd"`` truncates them;
``packing=PackingArguments(...)`` overrides these and sets the rest. docs/guides/trainers.md says
what is refused and why.
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
    """``trl.SFTTrainer`` with thdpack's packing, CP and exact loss.

    Args:
        *args, **kwargs: ``trl.SFTTrainer``'s; ``args`` must be an ``SFTConfig`` (its ``max_length``
            is the pack size, its ``packing_strategy`` the overflow), and not ``data_collator``.
        packing: thdpack's settings; they override the ``SFTConfig``'s and set what TRL has no
            setting for (``cp_placement``, ``cp_size`` without accelerate's ``ParallelismConfig``, ...).
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
