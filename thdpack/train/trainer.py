"""The training loop: packed THD batches, CP-sharded, dp x cp replicas, globally normalised loss.

One optimizer step on rank r:
1. the step's packs are dealt to the DP ranks (``thdpack.packing.step_stream.StepStream``); this rank's micro-batches
   are collated to THD (metadata on the host) and CP-sharded (``cp.shard``);
2. one collective counts the global loss tokens (``loss.StepLoss``); each micro-batch's loss is
   ``sum(token losses) / global count * world_size``, because DDP / FSDP2 average gradients over
   the whole dp x cp world while the step's gradient is the SUM of every rank's share;
3. gradients are synchronised on the last micro-batch only, clipped, and applied.
The loss and gradients then equal those of the same global batch run unpacked on one process.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from thdpack.data.prepared_plan import read_prepared_plan
from thdpack.data.store import TokenStore
from thdpack.models.config import ModelConfig
from thdpack.models.hf.causal_lm import HFCausalLM, HFModelConfig, build_hf_model
from thdpack.models.transformer import Transformer
from thdpack.packing.dataset import PackedDataset
from thdpack.packing.packer import Pack
from thdpack.packing.runtime import PackingRuntime
from thdpack.packing.step_stream import Step, StepStream
from thdpack.perf.time_cost import timing_of
from thdpack.plan.config import PlanConfig
from thdpack.thd.batch import thd_pin_memory, thd_to_device
from thdpack.thd.format import THDBatch
from thdpack.train.activation_checkpointing import checkpoint_layers
from thdpack.train.checkpoint import (
    load_checkpoint,
    open_checkpoints,
    read_stream_state,
    read_trainer_state,
    save_checkpoint,
)
from thdpack.train.config import Config, TrainConfig
from thdpack.train.export import checkpoint_export, publish_hf_folder
from thdpack.train.forward_backward import (
    clip_grad_norm,
    collate_micro_batches,
    forward_backward,
    nonfinite_parameters,
    parameters_finite,
    prepare_micro_batches,
)
from thdpack.train.identity import check_resume_identity, run_identity
from thdpack.train.metrics import MetricsLog, StepMetrics, padding_comparison, plot_loss, summary
from thdpack.train.output_dir import hold_output_dir
from thdpack.train.precision import Precision
from thdpack.train.prefetch import StepPrefetcher
from thdpack.train.runtime import RankTimeoutError, Runtime, init_runtime, is_collective_timeout, shutdown
from thdpack.train.store_cache import check_model_tokenizer, open_token_store, pad_id_of, real_lengths_summary
from thdpack.train.watchdog import Watchdog

log = logging.getLogger(__name__)


def lr_lambda(train: TrainConfig):
    """Linear warmup to ``lr``, then cosine decay to ``min_lr`` at the last step (a factor of lr).

    The schedule counts optimizer steps, as ``train.steps``, ``warmup_steps``, ``stop_at`` and
    ``checkpoint_every`` do: a run resumed with another global batch continues it by steps (each
    step then holds the new number of packs)."""

    def factor(step: int) -> float:
        if step < train.warmup_steps:
            return (step + 1) / train.warmup_steps
        progress = (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps)
        floor = train.min_lr / train.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def build_model(cfg: Config, runtime: Runtime, vocab_size: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(wrapped model, inner model): identical initial weights on every rank, then DDP or FSDP2
    over the whole dp x cp world (CP ranks hold the same parameters and sum their gradients)."""
    model_cfg = cfg.model_config()
    model_vocab = model_vocab_size(model_cfg)
    if model_vocab < vocab_size:  # before building: a large model is not built only to be refused
        raise ValueError(
            f"the model's vocabulary ({model_vocab}) is smaller than the tokenizer's ({vocab_size}); "
            f"set model.vocab_size={vocab_size}, or a data.tokenizer that matches the model"
        )
    precision = Precision.named(cfg.train.precision)
    if isinstance(model_cfg, HFModelConfig):
        inner = build_hf_model(model_cfg, seed=cfg.train.seed, device=runtime.device, dtype=precision.param_dtype)
    else:
        inner = Transformer(model_cfg, seed=cfg.train.seed, device=runtime.device, dtype=precision.param_dtype)
    if cfg.train.activation_checkpointing:
        checkpoint_layers(inner.layers)
    if cfg.parallel.dp_sharding == "fsdp":
        from torch.distributed.fsdp import fully_shard

        policy = precision.fsdp_policy()
        options = {} if policy is None else {"mp_policy": policy}
        for block in inner.layers:
            fully_shard(block, mesh=runtime.world_mesh, **options)
        fully_shard(inner, mesh=runtime.world_mesh, **options)
        return inner, inner
    device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
    return DistributedDataParallel(inner, device_ids=device_ids), inner


def model_vocab_size(model_cfg: ModelConfig | HFModelConfig) -> int:
    """The model's vocabulary, known before it is built (an HF folder's config.json)."""
    return model_cfg.model_vocab_size() if isinstance(model_cfg, HFModelConfig) else model_cfg.vocab_size


def build_optimizer(model: torch.nn.Module, train: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=train.lr, betas=(0.9, 0.95))


def shard_micro_batches(micro_batches: list[list[Pack]], runtime: Runtime, *, reduction: str) -> list[THDBatch]:
    """This rank's CP shards of its micro-batches (lists of packs), as THD batches on its device."""
    host = host_micro_batches(micro_batches, runtime, reduction=reduction)
    return [thd_to_device(mb, runtime.device, non_blocking=True) for mb in host]


def host_micro_batches(micro_batches: list[list[Pack]], runtime: Runtime, *, reduction: str) -> list[THDBatch]:
    """:func:`shard_micro_batches` without the copy: on the host, pinned when the device is CUDA
    (the prefetch thread's half of the work; the training loop copies them, non-blocking)."""
    host = prepare_micro_batches(
        collate_micro_batches(micro_batches),
        topology=runtime.topology,
        device=torch.device("cpu"),
        reduction=reduction,
    )
    return [thd_pin_memory(mb) for mb in host] if runtime.device.type == "cuda" else host


def run(cfg: Config, *, config_text: str | None = None) -> list[dict[str, Any]]:
    """Train with ``cfg`` in this process (one rank of torchrun, or alone); returns the metrics.

    The main rank holds ``train.output_dir``'s lock for the whole run (``thdpack.train.output_dir``):
    a second run into it stops at once, naming this one. ``config_text`` (the Hydra entry's composed
    config) is written to ``output_dir/config.yaml`` once the run holds the folder and its
    checkpoints passed the resume checks, so a refused run never overwrites an earlier run's.
    """
    runtime = init_runtime(cfg.parallel, cp_placement=cfg.packing_config.plan.cp_placement)
    try:
        with hold_output_dir(Path(cfg.train.output_dir), is_main=runtime.is_main):
            return _train(cfg, runtime, config_text)
    except RuntimeError as err:
        if is_collective_timeout(err):
            raise RankTimeoutError(
                f"rank {runtime.topology.rank}: a collective waited parallel.timeout_s={cfg.parallel.timeout_s:g} s "
                f"for ranks that did not come ({str(err).strip()}); a rank stopped, hung or died: see the watchdog's "
                "report and that rank's output, then continue from the last checkpoint with train.resume=true"
            ) from err
        raise
    finally:
        shutdown()


def _say(runtime: Runtime, text: str) -> None:
    if runtime.is_main:
        print(text, flush=True)


@dataclass(frozen=True)
class RunData:
    """The run's token store, its packed dataset and this rank's stream of steps."""

    store: TokenStore
    dataset: PackedDataset
    stream: StepStream


def open_run_data(cfg: Config, runtime: Runtime) -> RunData:
    """The token store (verified, and tokenized with the model folder's tokenizer when it ships
    one), the dataset over it with the run's ``PackingRuntime`` (CP size, DP rank and size, pad id)
    beside the packing settings, and the step stream. With ``data.store``, epoch 0 trains on the
    store's prepared plan when it was planned with the run's settings (else the note says which
    setting differs)."""
    store = open_token_store(
        cfg.data,
        vocab_size=model_vocab_size(cfg.model_config()),
        is_local_main=runtime.local_rank == 0,
        barrier=runtime.long_barrier,  # tokenizing a cache or verifying a large store may take long
    )
    note = check_model_tokenizer(cfg.model_config(), store)
    if note is not None and runtime.is_main:
        log.warning(note)
    origin = cfg.data.store if cfg.data.store is not None else ", ".join(cfg.data.inputs)
    _say(runtime, f"data: {origin} -> {store}: {real_lengths_summary(store.lengths)}")
    packing = cfg.packing_config
    topology = runtime.topology
    first_plan = None
    timing = timing_of(packing.plan, topology.gpus_per_node)  # a timed plan's machine and model, on these nodes
    if cfg.data.store is not None:
        prepared = read_prepared_plan(store.path, store.manifest, packing.plan, cp_size=topology.cp_size,
                                      timing=timing)  # fmt: skip
        _say(runtime, prepared.note)
        first_plan = prepared.plan
    context = PackingRuntime.from_topology(topology, pad_id=pad_id_of(store), timing=timing)
    dataset = packing.build(store, context, lengths=store.lengths, first_plan=first_plan)
    _say(runtime, f"packing plan (epoch 0):\n{dataset.stats}\n{padding_comparison(store.lengths, dataset.stats)}")
    placement = dataset.plan.placement_summary()
    if placement is not None:
        _say(runtime, placement)
    train = cfg.train
    stream = dataset.step_stream(micro_batches=train.micro_batches, packs_per_micro_batch=train.packs_per_micro_batch)
    return RunData(store=store, dataset=dataset, stream=stream)


@dataclass(frozen=True)
class Training:
    """The model (wrapped for DDP / FSDP2, and the inner module), its optimizer and schedule."""

    model: torch.nn.Module
    inner: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    autocast: Callable[[torch.device], contextlib.AbstractContextManager] | None
    """The forward pass's context under DDP (FSDP2's MixedPrecisionPolicy already computes in bf16)."""


def build_training(cfg: Config, runtime: Runtime, vocab_size: int) -> Training:
    model, inner = build_model(cfg, runtime, vocab_size)
    optimizer = build_optimizer(model, cfg.train)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.train))
    params = sum(p.numel() for p in inner.parameters())
    _say(runtime, f"model: {params:,} parameters, {cfg.model_config()}, precision {cfg.train.precision}")
    precision = Precision.named(cfg.train.precision)
    autocast = None if cfg.parallel.dp_sharding == "fsdp" else precision.autocast
    return Training(model=model, inner=inner, optimizer=optimizer, scheduler=scheduler, autocast=autocast)


@dataclass(frozen=True)
class Resume:
    """The checkpoint a run continues from, its ``trainer.pt`` read and its identity checked."""

    folder: Path
    trainer: dict[str, Any]
    data_changed: bool
    """The data or tokenizer differ from the checkpoint's and ``train.resume_data_changed`` allows it."""

    @property
    def step(self) -> int:
        return int(self.trainer["step"])


def open_resume(cfg: Config, runtime: Runtime, identity: dict[str, Any]) -> Resume | None:
    """The checkpoint to resume from (``train.resume``), or None to start at step 1.

    Its ``trainer.pt`` is compared with the run before any weight is loaded: the data, tokenizer
    and model it was trained with (``thdpack.train.identity``), and its step with ``train.steps``
    (a checkpoint past the end is refused).
    """
    train = cfg.train
    checkpoints = Path(train.output_dir) / "checkpoints"
    folder = open_checkpoints(checkpoints, resume=train.resume, overwrite=train.overwrite)
    if folder is None:
        if train.resume:
            _say(runtime, f"train.resume=true but {checkpoints} holds no checkpoint: starting from step 1")
        return None
    trainer = read_trainer_state(folder)
    changed = check_resume_identity(trainer, identity, folder=folder, data_changed=train.resume_data_changed)
    resume = Resume(folder=folder, trainer=trainer, data_changed=changed)
    if resume.step > train.steps:
        raise ValueError(
            f"checkpoint {folder} is at step {resume.step}, past train.steps={train.steps}; set train.steps above "
            f"{resume.step} to train on from it, or start over with train.overwrite=true"
        )
    return resume


STREAM_SETTING_NAMES = {
    "cp_size": "parallel.cp_size",
    "micro_batches": "train.micro_batches",
    "packs_per_micro_batch": "train.packs_per_micro_batch",
    "dp_size": "data-parallel size (processes / parallel.cp_size)",
    "timing_sha256": "step-time model (packing.profile, packing.model_shape on these nodes)",
    **{key: f"packing.{key}" for key in ("shuffle", "balance", *PlanConfig.__dataclass_fields__)},
}
"""What the trainer's users call each setting of the data stream (``StepStream.load_state_dict``)."""


def resume_training(
    cfg: Config, runtime: Runtime, training: Training, stream: StepStream, resume: Resume | None
) -> int:
    """The first step to run: 1, or the step after the checkpoint ``resume`` (model, optimizer,
    schedule, data stream and RNG restored; with other data, the stream starts at its beginning).

    The checkpoint may come from another layout: another number of processes or nodes, of
    micro-batches, DDP or FSDP2, other packing or CP settings. The stream continues from its global
    position (``StepStream.load_state_dict``: the same packs in the same steps when the packs per
    step and the plan settings are the same, else the rest of the epoch planned again), and one
    line says what changed and what it means."""
    if resume is None:
        return 1
    restored = load_checkpoint(resume.folder, model=training.model, optimizer=training.optimizer)
    scheduler, optimizer = training.scheduler, training.optimizer
    scheduler.load_state_dict(restored.trainer["scheduler"])
    # the schedule of *this* config at the restored step (train.steps may have been extended)
    factor = lr_lambda(cfg.train)(scheduler.last_epoch)
    for group, base_lr in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = base_lr * factor
    if resume.data_changed:
        _say(
            runtime,
            f"resumed from {resume.folder} (step {restored.step}) on other data (train.resume_data_changed=true): "
            "the model, optimizer and schedule continue, the data stream starts at this data's beginning",
        )
    else:
        saved = read_stream_state(resume.folder, restored.trainer)
        change = stream.load_state_dict(saved, names=STREAM_SETTING_NAMES)
        _say(runtime, f"resumed from {resume.folder} (step {restored.step})")
        if change.message is not None:
            _say(runtime, f"data: {change.message}")
    return restored.step + 1


def _train(cfg: Config, runtime: Runtime, config_text: str | None) -> list[dict[str, Any]]:
    start_wall = time.perf_counter()
    train = cfg.train
    out = Path(train.output_dir)
    torch.manual_seed(train.seed)
    topology = runtime.topology
    _say(
        runtime,
        f"world {topology.world_size} = dp {topology.dp_size} x cp {topology.cp_size} on {runtime.device} "
        f"({dist.get_backend()}), {cfg.parallel.dp_sharding.upper()}",
    )
    data = open_run_data(cfg, runtime)
    identity = run_identity(cfg, data.store)
    resume = open_resume(cfg, runtime, identity)  # before the model is built: another model is refused first
    if runtime.is_main and config_text is not None:
        (out / "config.yaml").write_text(config_text)
    last_step = train.stop_at or train.steps
    if resume is not None and resume.step >= last_step:
        until = f"train.stop_at={train.stop_at}" if train.stop_at else f"train.steps={train.steps}"
        _say(
            runtime,
            f"checkpoint {resume.folder} is at step {resume.step}, and this run ends at step {last_step} ({until}): "
            f"nothing left to train; raise {until.split('=')[0]} to train on",
        )
        return []
    training = build_training(cfg, runtime, int(data.store.manifest["tokenizer"]["vocab_size"]))
    first_step = resume_training(cfg, runtime, training, data.stream, resume)
    metrics = MetricsLog(out / "metrics.jsonl", resume_step=first_step - 1) if runtime.is_main else None
    prepare = _host_batches(runtime, train.loss_reduction)
    with (
        StepPrefetcher(
            data.stream, prepare, depth=train.prefetch_steps, before_read=data.store.check_unchanged
        ) as steps,
        _watchdog(cfg, runtime) as watchdog,
    ):
        last_saved = _loop(cfg, runtime, training, steps, metrics, first_step, identity, watchdog)
    if isinstance(training.inner, HFCausalLM) and runtime.is_main and last_saved is not None:
        published = publish_hf_folder(last_saved, out)
        print(f"wrote {published} (transformers.AutoModelForCausalLM.from_pretrained loads it)")

    history = metrics.history if metrics is not None else []
    if runtime.is_main:
        print("\n" + summary(history, wall_seconds=time.perf_counter() - start_wall, stats=data.dataset.stats))
        print(padding_comparison(data.store.lengths, data.dataset.stats))
        if train.plot and plot_loss(history, out / "loss.png"):
            print(f"wrote {out / 'loss.png'}")
        print(f"wrote {out / 'metrics.jsonl'}")
    return history


def _watchdog(cfg: Config, runtime: Runtime) -> contextlib.AbstractContextManager[Watchdog | None]:
    """The stall reporter of this rank (``thdpack.train.watchdog``); none for one process or with
    ``parallel.watchdog_s=0``."""
    topology = runtime.topology
    if topology.world_size == 1 or cfg.parallel.watchdog_s == 0:
        return contextlib.nullcontext()
    return Watchdog(
        Path(cfg.train.output_dir) / "heartbeats",
        rank=topology.rank,
        world_size=topology.world_size,
        report_after=cfg.parallel.watchdog_s,
        timeout_s=cfg.parallel.timeout_s,
    )


def _host_batches(runtime: Runtime, reduction: str) -> Callable[[Step], list[THDBatch]]:
    return lambda step: host_micro_batches(step.micro_batches, runtime, reduction=reduction)


def _loop(
    cfg: Config,
    runtime: Runtime,
    training: Training,
    steps: StepPrefetcher,
    metrics: MetricsLog | None,
    first_step: int,
    identity: dict[str, Any],
    watchdog: Watchdog | None,
) -> Path | None:
    """Steps ``first_step .. stop_at or steps``: no host sync inside a step until its optimizer
    update is queued (the loss, the gradient norm and whether every parameter is finite are read
    back after it). A step whose loss, gradient or parameters are not finite stops the run before it
    is saved. Returns the last checkpoint saved (None when the run had no step left)."""
    folder = None
    train = cfg.train
    model, optimizer, scheduler = training.model, training.optimizer, training.scheduler
    checkpoints = Path(train.output_dir) / "checkpoints"
    last_step = train.stop_at or train.steps
    for step_number in range(first_step, last_step + 1):
        if watchdog is not None:
            watchdog.step_started(step_number)
        tick = time.perf_counter()
        prepared = steps.next()
        step = prepared.step
        micro = [thd_to_device(mb, runtime.device, non_blocking=True) for mb in prepared.micro_batches]
        step_loss = forward_backward(model, micro, topology=runtime.topology, autocast=training.autocast)
        grad_norm_t = clip_grad_norm(model, train.grad_clip)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        finite_t = parameters_finite(training.inner)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss = float(step_loss.value())
        grad_norm = float(grad_norm_t)
        loss_tokens = int(step_loss.loss_tokens)
        seconds = time.perf_counter() - tick
        if metrics is not None:
            record = StepMetrics(
                step=step_number,
                epoch=step.epoch,
                loss=loss,
                lr=lr,
                grad_norm=grad_norm,
                tokens=step.tokens,
                loss_tokens=loss_tokens,
                capacity=step.capacity,
                sequences=step.sequences,
                efficiency=step.tokens / step.capacity,
                tokens_per_s=step.tokens / seconds,
                step_seconds=seconds,
                imbalance_tokens=step.imbalance.tokens,
                imbalance_attention=step.imbalance.attention,
                data_wait_seconds=steps.wait_seconds,
                packs_sha256=step.packs_sha256,
            )
            metrics.write(record)
            if step_number % train.log_every == 0 or step_number == train.steps:
                print(record.line(train.steps), flush=True)
        _check_finite(step_number, loss, grad_norm, bool(finite_t), training.inner, folder)
        every = train.checkpoint_every
        if step_number == last_step or (every and step_number % every == 0):
            trainer_state = {"scheduler": scheduler.state_dict(), "config": _plain(cfg), "identity": identity}
            export = None
            if isinstance(training.inner, HFCausalLM) and (train.save_hf or step_number == last_step):
                export = checkpoint_export(model, training.inner, cfg.data.tokenizer)
            folder = save_checkpoint(
                checkpoints,
                step_number,
                model=model,
                optimizer=optimizer,
                trainer_state=trainer_state,
                stream=prepared.stream_state,
                keep=train.keep_checkpoints,
                export=export,
            )
            _say(runtime, f"saved checkpoint {folder}")
        if watchdog is not None:
            watchdog.step_ended()
    return folder


def _check_finite(
    step: int, loss: float, grad_norm: float, params_finite: bool, model: torch.nn.Module, last_saved: Path | None
) -> None:
    """``FloatingPointError`` naming the step when its loss, its gradient norm or a parameter after
    its update is not finite (the same on every rank: the values are global)."""
    if math.isfinite(loss) and math.isfinite(grad_norm) and params_finite:
        return
    if not math.isfinite(loss):
        what = f"the loss is {loss}"
    elif not math.isfinite(grad_norm):
        what = f"the loss is {loss:.4f} but the gradient norm is {grad_norm} (a gradient holds NaN or infinity)"
    else:
        names = nonfinite_parameters(model)
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        what = f"after the optimizer step, parameters hold NaN or infinity ({shown or 'on another rank'})"
    kept = f"the last checkpoint is {last_saved}" if last_saved is not None else "no checkpoint of this run was saved"
    raise FloatingPointError(
        f"step {step}: {what}; lower train.lr or check the data. The run stops without saving this step ({kept})"
    )


def _plain(cfg: Config) -> dict[str, Any]:
    return {name: asdict(getattr(cfg, name)) for name in ("data", "model", "packing", "parallel", "attention", "train")}
