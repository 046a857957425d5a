"""transformers' ``Trainer`` with thdpack's packing, context parallelism and exact loss.

One class changes (``ThdpackTrainer`` for ``Trainer``; ``thdpack.integrations.trl.SFTTrainer`` for
TRL's)::

    trainer = ThdpackTrainer(model=model, args=TrainingArguments("out", gradient_accumulation_steps=4),
                             train_dataset=tokenized, packing=PackingArguments(pack_size=8192, cp_size=2))
    trainer.train()          # torchrun --nproc-per-node 4 train.py   (dp 2 x cp 2)

The mixin replaces the Trainer's batches (thdpack's step stream, each rank its CP shard), its
attention under CP (thdpack's), its loss (``StepLoss``, the unpacked token mean) and accelerate's
CP hook, and keeps the stream's state in every checkpoint. What it refuses, and the Trainer
internals it relies on, are listed in docs/guides/trainers.md.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from thdpack._optional import require
from thdpack.cp.partition import shard
from thdpack.cp.topology import CpTopology
from thdpack.integrations.packing_arguments import PackingArguments
from thdpack.integrations.parallel import accelerator_topology
from thdpack.integrations.stream_state import read_stream_state, write_stream_state
from thdpack.integrations.trainer_data import (
    MICRO_BATCH_KEY,
    STEP_LABELS_KEY,
    HFSamples,
    StepSource,
    packed_dataset,
    packed_step_loader,
)
from thdpack.loss import StepLoss
from thdpack.models.hf.attention import (
    ATTENTION_CONFIG_KWARG,
    POSITION_MASKED,
    VARLEN,
    check_hf_attention,
    hf_packed_kwargs,
    register_hf_attention,
)
from thdpack.packing.packer import pack_from_segments
from thdpack.plan.config import PlanConfig
from thdpack.plan.overflow import Overflow
from thdpack.thd.batch import thd_collate
from thdpack.train.output_dir import hold_output_dir

transformers = require("transformers", "thdpack.integrations.transformers")
require("accelerate", "thdpack.integrations.transformers")  # the Trainer's own dependency: name the extra
from transformers import Trainer, TrainerCallback  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint  # noqa: E402

__all__ = ["ATTENTION_NAME", "PackingArguments", "StreamCheckpoint", "ThdpackTrainer", "ThdpackTrainerMixin"]

log = logging.getLogger(__name__)

ATTENTION_NAME = "thdpack"
"""The ``attn_implementation`` name thdpack's attention is registered under."""
STREAM_SETTING_NAMES = {
    "cp_size": "cp_size (PackingArguments / ParallelismConfig)",
    "micro_batches": "gradient_accumulation_steps",
    "packs_per_micro_batch": "per_device_train_batch_size",
    "dp_size": "data-parallel size (processes / cp_size)",
    "seed": "data_seed (or seed)",
    "pack_size": "pack size (PackingArguments.pack_size, SFTConfig.max_length)",
    "timing_sha256": "step-time model (PackingArguments.profile, model_shape)",
    **{key: f"PackingArguments.{key}" for key in ("shuffle", "balance", *PlanConfig.__dataclass_fields__)
       if key not in ("seed", "pack_size")},
}  # fmt: skip
"""What the Trainer integrations' users call each setting of the pack stream (its resume message)."""


class ThdpackTrainerMixin:
    """What ``ThdpackTrainer`` and the TRL ``SFTTrainer`` add to a ``transformers.Trainer``: thdpack's
    batches, attention under CP, loss and stream state (docs/guides/trainers.md, "What the trainers do").

    A subclass calls ``_setup_packing`` at the end of its ``__init__``."""

    loss_is_scaled_for_ga = True
    """``StepLoss`` normalises over the whole step: the Trainer must not divide by the accumulation steps."""

    def _setup_packing(self, packing: PackingArguments, *, pack_size: int, overflow: Overflow) -> None:
        if not hasattr(Trainer, "loss_is_scaled_for_ga") or not hasattr(Trainer, "_prepare_context_parallel_inputs"):
            raise ImportError(
                f"transformers {transformers.__version__} lacks Trainer.loss_is_scaled_for_ga or "
                "Trainer._prepare_context_parallel_inputs, which thdpack's Trainer integration relies on "
                "(tested with transformers 5.24)"
            )
        self._check_arguments()
        self.packing = packing
        self.topology = accelerator_topology(
            self.accelerator, packing.cp_size, placement_groups=packing.cp_placement != "te"
        )
        # the loss is StepLoss's: counting num_items_in_batch would cost a collective for nothing
        self.model_accepts_loss_kwargs = False
        samples = HFSamples(self.train_dataset, vocab_size=_vocab_size(self.accelerator.unwrap_model(self.model)))
        lengths = samples.lengths()
        samples.check_token_ids()
        self._samples = samples
        args = self.args
        config = packing.dataset_config(
            pack_size=pack_size, overflow=overflow, seed=args.data_seed if args.data_seed is not None else args.seed
        )
        self.packed_dataset = packed_dataset(
            config, samples, self.topology, pad_id=_pad_id(self.model), lengths=lengths
        )
        model = self.accelerator.unwrap_model(self.model)
        _use_thdpack_attention(model, self.topology.cp_size)
        _check_model(model, int(min(lengths.max(initial=1), pack_size)), pack_size, self.topology)
        self._step_loss: StepLoss | None = None
        self._resume_state: dict[str, Any] | None = None
        self.add_callback(StreamCheckpoint())
        stats = self.packed_dataset.stats
        placement = self.packed_dataset.plan.placement_summary()
        if self.accelerator.is_main_process:
            log.info(
                "thdpack: dp %d x cp %d, %s attention; packing plan of epoch 0:\n%s%s",
                self.topology.dp_size,
                self.topology.cp_size,
                model.config._attn_implementation,
                stats,
                f"\n{placement}" if placement else "",
            )
            if stats.dropped_sequences or stats.truncated_tokens:
                log.warning(
                    "thdpack: overflow=%r: %d sequences dropped (%d tokens), %d tokens truncated, of sequences longer "
                    "than pack_size=%d; overflow='split' keeps every token",
                    overflow,
                    stats.dropped_sequences,
                    stats.dropped_tokens,
                    stats.truncated_tokens,
                    pack_size,
                )

    def _check_arguments(self) -> None:
        args = self.args
        loss = "the loss is thdpack's token-mean cross-entropy"
        refusals = {
            "nn.DataParallel (several GPUs in one process): launch with torchrun": args.n_gpu > 1,
            "DeepSpeed: use DDP or FSDP through accelerate": self.is_deepspeed_enabled,
            "model_init (hyperparameter search): pass the model": self.model_init is not None,
            f"label_smoothing_factor > 0: {loss}": self.label_smoother is not None,
            f"compute_loss_func: {loss}": self.compute_loss_func is not None,
            "evaluation (eval_dataset / eval_strategy): thdpack has no packed evaluation loop yet; evaluate with a "
            "plain Trainer on the saved model": self.eval_dataset is not None or args.eval_strategy != "no",
        }
        refused = [reason for reason, applies in refusals.items() if applies]
        if refused:
            raise ValueError(f"{type(self).__name__} cannot train with {'; '.join(refused)}")
        if args.dataloader_num_workers:
            log.warning(
                "dataloader_num_workers=%d is not used: thdpack builds each step's packs in the training process, "
                "in order, so that the checkpoint records the stream's exact position",
                args.dataloader_num_workers,
            )

    # -- data --------------------------------------------------------------------------------
    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        args = self.args
        stream = self.packed_dataset.step_stream(
            micro_batches=args.gradient_accumulation_steps, packs_per_micro_batch=args.per_device_train_batch_size
        )
        source = StepSource(
            stream,
            cp_size=self.topology.cp_size,
            cp_rank=self.topology.cp_rank,
            device=args.device,
            num_examples=len(self._samples),
            data=self._samples.identity,
        )
        saved = self._resume_state
        if saved is not None and saved.get("stream") is None:  # other data (resume_data_changed): its beginning
            source.steps_done = int(saved["steps_done"])
        elif saved is not None:
            change = source.load_state_dict(saved, names=STREAM_SETTING_NAMES)
            if change.message is not None and self.accelerator.is_main_process:
                log.warning("thdpack: resumed pack stream: %s", change.message)
        steps_per_epoch = max(1, math.ceil(self.packed_dataset.stats.num_packs / stream.packs_per_step))
        return packed_step_loader(
            source, steps_per_epoch=steps_per_epoch, micro_batches=args.gradient_accumulation_steps
        )

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train`` holding ``output_dir`` (one run per folder: the module docstring); a
        resumed run first restores the pack stream saved in the checkpoint."""
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
        self._resume_state = None
        if isinstance(checkpoint, str):
            if self.args.ignore_data_skip:
                raise ValueError(
                    "ignore_data_skip=True would retrain the packs the checkpoint already trained on; thdpack resumes "
                    "the pack stream exactly where the checkpoint left it: leave ignore_data_skip=False"
                )
            self._resume_state = self._saved_stream(Path(checkpoint))
        out = Path(self.args.output_dir)
        resumed = None if not isinstance(checkpoint, str) else Path(checkpoint)
        with hold_output_dir(
            out, is_main=self.accelerator.is_main_process, setting="output_dir",
            check=lambda: refuse_other_checkpoints(out, resumed),
        ):  # fmt: skip
            return super().train(checkpoint if checkpoint is not None else resume_from_checkpoint, *args, **kwargs)

    def _saved_stream(self, checkpoint: Path) -> dict[str, Any]:
        """The checkpoint's pack stream state, its data compared with this run's first: another
        dataset (other examples, or the same number of other ones) is refused unless
        ``PackingArguments(resume_data_changed=True)``, which starts the stream at this data's
        beginning (its ``"stream"`` is then None)."""
        saved = read_stream_state(checkpoint)
        recorded, mine = saved.get("data"), self._samples.identity()
        if recorded is None:
            log.warning(
                "thdpack: %s records no digest of its data (an older thdpack wrote it): not compared", checkpoint
            )
            return saved
        if recorded == mine:
            return saved
        differs = "; ".join(
            f"{key}: checkpoint {_short(recorded.get(key))}, this run {_short(mine[key])}"
            for key in mine
            if recorded.get(key) != mine[key]
        )
        if not self.packing.resume_data_changed:
            raise ValueError(
                f"checkpoint {checkpoint} was trained on other data than this train_dataset ({differs}); resume with "
                "the data it was trained on, or pass PackingArguments(resume_data_changed=True) to continue its model "
                "on this data (the pack stream then starts at this data's beginning)"
            )
        log.warning("thdpack: resuming on other data (%s): the pack stream starts at this data's beginning", differs)
        return {"steps_done": saved["steps_done"], "stream": None}

    # -- loss --------------------------------------------------------------------------------
    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """This rank's share of the step's global token-mean loss (``StepLoss``), ready for backward."""
        if STEP_LABELS_KEY not in inputs:
            raise ValueError(
                f"{type(self).__name__} computes the loss of thdpack's packed micro-batches only; got a batch with "
                f"keys {sorted(inputs)}"
            )
        if inputs[MICRO_BATCH_KEY] == 0:  # one collective per step: the global count of loss tokens
            self._step_loss = StepLoss.begin(inputs[STEP_LABELS_KEY], topology=self.topology)
        assert self._step_loss is not None, "micro-batch 0 of every step comes first"
        outputs = model(**self.model_kwargs(inputs))
        loss = self._step_loss(outputs.logits[0], inputs["labels"])
        return (loss, outputs) if return_outputs else loss

    def model_kwargs(self, thd: Mapping[str, Any]) -> dict[str, Any]:
        """The model call for a micro-batch (``hf_packed_kwargs``: ids, positions, THD metadata, topology)."""
        hf_model = self.accelerator.unwrap_model(self.model)
        kwargs = hf_packed_kwargs(thd, cp_group=self.topology, model=hf_model)
        kwargs[ATTENTION_CONFIG_KWARG] = self.packing.attention
        return kwargs

    def _prepare_context_parallel_inputs(self, model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[Callable, Any]:
        # thdpack takes the place of accelerate's CP: the micro-batch already is this rank's shard (of
        # the packs' placement), and accelerate's context_parallel would re-split it and attend across documents
        return contextlib.nullcontext, inputs

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        raise ValueError(
            f"{type(self).__name__} has no packed evaluation loop yet; evaluate the saved model with a plain Trainer"
        )


class ThdpackTrainer(ThdpackTrainerMixin, Trainer):
    """``transformers.Trainer`` with thdpack's packing, CP and loss.

    Args:
        *args, **kwargs: ``transformers.Trainer``'s (``model``, ``args``, ``train_dataset`` of
            ``input_ids`` and optional unshifted ``labels``, ...); not ``data_collator`` (thdpack
            builds the batches) nor ``model_init``.
        packing: thdpack's settings; ``pack_size`` is required.
    """

    def __init__(self, *args: Any, packing: PackingArguments | None = None, **kwargs: Any) -> None:
        refuse_data_collator(Trainer.__init__, args, kwargs)
        super().__init__(*args, **kwargs)
        packing = packing or PackingArguments()
        if packing.pack_size is None:
            raise ValueError("ThdpackTrainer needs packing=PackingArguments(pack_size=...), the tokens per pack")
        self._setup_packing(packing, pack_size=packing.pack_size, overflow=packing.overflow or "error")


def _short(value: Any) -> str:
    """A sha256 as its first 12 digits (enough to tell two apart in a message)."""
    return f"{value[:12]}..." if isinstance(value, str) and len(value) == 64 else str(value)


def refuse_other_checkpoints(out: Path, resumed: Path | None) -> None:
    """``ValueError`` when ``out`` holds ``checkpoint-N`` folders of another run: a fresh run (or one
    resumed from a checkpoint elsewhere) would overwrite them, and the Trainer's rotation delete them."""
    found = sorted(
        (p for p in out.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir() and p.name.split("-")[-1].isdigit()),
        key=lambda p: int(p.name.split("-")[-1]),
    )
    if not found or (resumed is not None and resumed.resolve().parent == out.resolve()):
        return
    shown = ", ".join(p.name for p in found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    raise ValueError(
        f"output_dir={out} holds the checkpoints of an earlier run ({shown}); continue it with "
        "train(resume_from_checkpoint=True), write to a new output_dir, or delete them"
    )


def refuse_data_collator(init: Callable, args: tuple, kwargs: dict[str, Any]) -> None:
    """Raise when the trainer's arguments include a ``data_collator``: thdpack builds the batches."""
    bound = inspect.signature(init).bind_partial(None, *args, **kwargs)
    if bound.arguments.get("data_collator") is not None:
        raise ValueError(
            "data_collator would never be called: thdpack builds the packed batches (collate, CP shard); drop it"
        )


class StreamCheckpoint(TrainerCallback):
    """Writes the pack stream's state into every checkpoint folder (``STATE_FILE``)."""

    def on_save(self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kwargs: Any) -> None:
        source = getattr(train_dataloader, "dataset", None)
        if not isinstance(source, StepSource):
            raise RuntimeError("StreamCheckpoint saves thdpack's pack stream; the Trainer's loader is not thdpack's")
        if source.steps_done != state.global_step:
            raise RuntimeError(
                f"the pack stream built {source.steps_done} steps but the Trainer is at step {state.global_step}: "
                "the checkpoint would resume elsewhere"
            )
        if args.should_save:
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            write_stream_state(folder, source.state_dict())


def _vocab_size(model: torch.nn.Module) -> int | None:
    """Rows of the model's input embedding (what an id must stay below), None when it has none."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    return getattr(embedding, "num_embeddings", None)


def _pad_id(model: torch.nn.Module) -> int:
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    return pad if isinstance(pad, int) else 0


def _use_thdpack_attention(model: torch.nn.Module, cp_size: int) -> None:
    """Under CP, switch transformers' own implementations to thdpack's registered attention (the
    same function: causal softmax attention, computed across the CP ranks); others stay and are
    checked by ``check_hf_attention``."""
    register_hf_attention(ATTENTION_NAME)
    current = model.config._attn_implementation
    if cp_size > 1 and current in (*POSITION_MASKED, *VARLEN, None):
        model.set_attn_implementation(ATTENTION_NAME)
        log.info("thdpack: attention %r -> %r (CP %d needs it)", current, ATTENTION_NAME, cp_size)


def _check_model(model: torch.nn.Module, longest: int, pack_size: int, topology: CpTopology) -> None:
    """``check_hf_attention`` on a pack holding the longest sequence, before any training: an
    attention implementation, softcap, window or layer kind that cannot be exact is refused now."""
    sample = {"input_ids": np.zeros(longest, dtype=np.int64)}
    pack = pack_from_segments([sample], ([0], [0], [longest]), pack_size, cp_size=topology.cp_size)
    thd = shard(thd_collate([pack]), topology.cp_size, topology.cp_rank)
    check_hf_attention(model, thd)
