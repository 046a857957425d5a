"""The training loop: packed THD batches, CP-sharded, dp x cp replicas, globally normalised loss.

One optimizer step on rank r:

1. the step's packs are dealt to the DP ranks (``thdpack.packing.step_stream.StepStream``); this
   rank's micro-batches are collated to THD (metadata on the host) and CP-sharded (``cp.shard``);
2. one collective counts the global loss tokens (``loss.StepLoss``); each micro-batch's loss is
   ``sum(token losses) / global count * world_size``, because DDP / FSDP2 average gradients over
   the whole dp x cp world while the step's gradient is the SUM of every rank's share;
3. gradients are synchronised on the last micro-batch only, clipped, and applied.

The loss and gradients then equal those of the same global batch run unpacked on one process.
The model and optimizer are built by ``thdpack.train.model_setup``; a resumed run's checkpoint is
chosen, checked and restored by ``thdpack.train.resume``.
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

from thdpack.data.prepared_plan import read_prepared_plan
from thdpack.data.store import TokenStore
from thdpack.models.hf.causal_lm import HFCausalLM
from thdpack.packing.dataset import PackedDataset
from thdpack.packing.packer import Pack
from thdpack.packing.runtime import PackingRuntime
from thdpack.packing.step_stream import Step, StepStream
from thdpack.perf.time_cost import timing_of
from thdpack.thd.batch import thd_pin_memory, thd_to_device
from thdpack.thd.format import THDBatch
from thdpack.train.checkpoint import save_checkpoint
from thdpack.train.config import Config
from thdpack.train.export import checkpoint_export, publish_hf_folder
from thdpack.train.forward_backward import (
    clip_grad_norm,
    collate_micro_batches,
    forward_backward,
    nonfinite_parameters,
    parameters_finite,
    prepare_micro_batches,
)
from thdpack.train.identity import run_identity
from thdpack.train.metrics import MetricsLog, StepMetrics, padding_comparison, plot_loss, summary
from thdpack.train.model_setup import Training, build_training, model_vocab_size
from thdpack.train.output_dir import hold_output_dir
from thdpack.train.prefetch import StepPrefetcher
from thdpack.train.resume import open_resume, resume_training
from thdpack.train.runtime import RankTimeoutError, Runtime, init_runtime, is_collective_timeout, shutdown
from thdpack.train.store_cache import check_model_tokenizer, open_token_store, pad_id_of, real_lengths_summary
from thdpack.train.watchdog import Watchdog

log = logging.getLogger(__name__)


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
    runtime.say(f"data: {origin} -> {store}: {real_lengths_summary(store.lengths)}")
    packing = cfg.packing_config
    topology = runtime.topology
    first_plan = None
    timing = timing_of(packing.plan, topology.gpus_per_node)  # a timed plan's machine and model, on these nodes
    if cfg.data.store is not None:
        prepared = read_prepared_plan(store.path, store.manifest, packing.plan, cp_size=topology.cp_size,
                                      timing=timing)  # fmt: skip
        runtime.say(prepared.note)
        first_plan = prepared.plan
    context = PackingRuntime.from_topology(topology, pad_id=pad_id_of(store), timing=timing)
    dataset = packing.build(store, context, lengths=store.lengths, first_plan=first_plan)
    runtime.say(f"packing plan (epoch 0):\n{dataset.stats}\n{padding_comparison(store.lengths, dataset.stats)}")
    placement = dataset.plan.placement_summary()
    if placement is not None:
        runtime.say(placement)
    train = cfg.train
    stream = dataset.step_stream(micro_batches=train.micro_batches, packs_per_micro_batch=train.packs_per_micro_batch)
    return RunData(store=store, dataset=dataset, stream=stream)


def _train(cfg: Config, runtime: Runtime, config_text: str | None) -> list[dict[str, Any]]:
    start_wall = time.perf_counter()
    train = cfg.train
    out = Path(train.output_dir)
    torch.manual_seed(train.seed)
    topology = runtime.topology
    runtime.say(
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
        runtime.say(
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
            runtime.say(f"saved checkpoint {folder}")
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
