"""Typed configs of the training run, one per Hydra group, registered in Hydra's ConfigStore.

Groups (YAML presets in ``configs/<group>/``): ``data``, ``model``, ``packing``, ``parallel``,
``attention``, ``train``. ``model`` and ``attention`` are generated twins of the components'
own frozen configs (``thdpack.models.ModelConfig``, ``thdpack.attention.AttentionConfig``);
the others belong to the trainer. Every ``__post_init__`` rejects bad values with the value,
the limit and the fix; ``Config`` adds the checks that span groups.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from thdpack.attention.config import AttentionConfig
from thdpack.data.bad_records import ON_BAD_RECORD
from thdpack.data.encode import CHAT_TEMPLATE_CHOICES
from thdpack.data.records import RECORD_KINDS
from thdpack.data.sources import SOURCE_FORMATS
from thdpack.layout.rules import check_pack_size
from thdpack.loss import LOSS_REDUCTIONS
from thdpack.models.config import ModelConfig
from thdpack.models.hf.causal_lm import HFModelConfig
from thdpack.packing.dataset import DATASET_SEED, PackedDatasetConfig
from thdpack.plan.config import TRAINING_CP_PLACEMENT
from thdpack.train.precision import PRECISIONS
from thdpack.train.schema import build, hydra_node

DP_SHARDINGS = ("ddp", "fsdp")
DEVICES = ("auto", "cpu", "cuda")
DIST_BACKENDS = ("auto", "gloo", "nccl")


def _one_of(name: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(repr(o) for o in options)}")


def _at_least(name: str, value: int | float, minimum: int | float) -> None:
    if not value >= minimum:  # `not >=`: NaN is refused too
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _shown(value: object) -> str:
    """``value`` as an override writes it (``true``, not ``True``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")


@dataclass(kw_only=True)
class DataConfig:
    """Where the training text comes from and how it becomes tokens (cached as a token store)."""

    inputs: list[str] = field(default_factory=lambda: ["stdlib"])
    """Files / folders read in order; 'stdlib' = this Python's standard library sources."""
    tokenizer: str = "gpt2"
    """'gpt2' (shipped with thdpack), a tokenizer.json path, or a Hugging Face tokenizer folder
    (tokenizer.json + tokenizer_config.json; its chat template renders chat records)."""
    format: str = "auto"
    """Input format (auto-detected from the path by default)."""
    kind: str = "auto"
    """Record kind: text, alpaca (SFT, prompt masked) or chat; auto-detected by default."""
    chat_template: str = "auto"
    """Chat records: the tokenizer's chat template when it has one (auto), always it (tokenizer),
    or the plain '### User:' template (plain)."""
    on_bad_record: str = "fail"
    """Records that cannot be samples (empty chat, no assistant turn, unknown role, bad JSON): fail
    naming the file and line, or skip them (counted per reason in the store's manifest.json,
    listed in its skipped_records.jsonl)."""
    limit: int | None = None
    """Read only the first N records (a quick trial); None reads everything."""
    cache_dir: str = "~/.cache/thdpack/stores"
    """Token stores are cached here, one per (inputs, tokenizer, limit, ...) fingerprint; a damaged
    one is rebuilt."""
    store: str | None = None
    """A token store folder written by ``thdpack prepare``, trained on as it is (the other data
    fields are then unused); verified in full before the first step, and a damaged one stops the
    run naming the file."""

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("data.inputs is empty: name at least one file, folder or 'stdlib'")
        _one_of("data.format", self.format, ("auto", *SOURCE_FORMATS))
        _one_of("data.kind", self.kind, ("auto", *RECORD_KINDS))
        _one_of("data.chat_template", self.chat_template, CHAT_TEMPLATE_CHOICES)
        _one_of("data.on_bad_record", self.on_bad_record, ON_BAD_RECORD)
        if self.limit is not None:
            _at_least("data.limit", self.limit, 1)


PACKING_FLATTEN = ("plan",)
PackingNode = hydra_node(
    PackedDatasetConfig,
    defaults=(("pack_size", 1024), ("seed", DATASET_SEED), ("cp_placement", TRAINING_CP_PLACEMENT)),
    flatten=PACKING_FLATTEN,
)
"""The ``packing`` group: ``thdpack.packing.PackedDatasetConfig``'s settings, its plan's
(``thdpack.plan.PlanConfig``) listed flat (``packing.pack_size``). The run's values (CP size, DP
rank and size, pad id) are not settings: the trainer passes them to ``build`` as a
``PackingRuntime``. The YAML presets set the training default ``overflow: split`` (no token lost)
over the component's ``error``; the trainer places sequences per CP rank (``cp_placement:
adaptive``) unless told ``te``."""


@dataclass(kw_only=True)
class ParallelConfig:
    """Data x context parallelism over the torchrun world (dp_size = world_size / cp_size)."""

    cp_size: int = 2
    """Context-parallel ranks per sequence; must divide the world size."""
    dp_sharding: str = "ddp"
    """How parameters and gradients are replicated over dp x cp: ddp or fsdp (FSDP2 fully_shard)."""
    device: str = "auto"
    """auto: cuda when available, else cpu."""
    backend: str = "auto"
    """torch.distributed backend; auto: nccl on cuda, gloo on cpu."""
    timeout_s: float = 600.0
    """How long a collective waits for the other ranks before the job fails (every process group
    of the run). torch's own default is 30 minutes (gloo): a stopped or hung rank would hold the
    whole allocation that long. Raise it when a legitimate wait inside training is longer (saving
    a very large checkpoint to a slow file system); the long waits before training (building the
    token cache, verifying a large store) use their own group and are not limited by it. Under
    torchrun a stopped rank (``kill -STOP``) ends about 30 s later still, after timeout_s + 30 s in
    all: torchrun stops a failed job's other workers with SIGTERM, which a stopped process never
    handles, and sends SIGKILL 30 s later (torch.distributed.elastic's fixed grace for a failed
    worker group; ``--shutdown-timeout`` does not shorten it as of torch 2.13)."""
    watchdog_s: float = 60.0
    """Report a step that has run longer than max(10 x the median step, watchdog_s), naming the
    ranks that have not arrived (``output_dir/heartbeats``); 0 turns the watchdog off."""

    def __post_init__(self) -> None:
        _at_least("parallel.cp_size", self.cp_size, 1)
        _finite("parallel.timeout_s", self.timeout_s)
        if not self.timeout_s > 0:
            raise ValueError(f"parallel.timeout_s must be > 0, got {self.timeout_s}")
        _finite("parallel.watchdog_s", self.watchdog_s)
        _at_least("parallel.watchdog_s", self.watchdog_s, 0)
        _one_of("parallel.dp_sharding", self.dp_sharding, DP_SHARDINGS)
        _one_of("parallel.device", self.device, DEVICES)
        _one_of("parallel.backend", self.backend, DIST_BACKENDS)


@dataclass(kw_only=True)
class TrainConfig:
    """The optimisation loop, logging, checkpoints."""

    steps: int = 60
    """Optimizer steps."""
    micro_batches: int = 1
    """Gradient-accumulation micro-steps per optimizer step (per DP rank)."""
    packs_per_micro_batch: int = 1
    """Packs (THD rows) in each micro-batch."""
    lr: float = 3e-3
    """Peak learning rate (AdamW), reached after warmup_steps, cosine-decayed to min_lr."""
    min_lr: float = 3e-4
    """Learning rate at the last step, the end of the cosine decay; 0 <= min_lr <= lr."""
    warmup_steps: int = 10
    """Steps of linear warmup from 0 to lr."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay; finite, >= 0."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    loss_reduction: str = "token_mean"
    """token_mean (the unpacked token mean over the global batch) or sequence_mean."""
    precision: str = "fp32"
    """fp32, bf16-mixed (fp32 master weights and optimizer state, bf16 compute: autocast under
    DDP, MixedPrecisionPolicy under FSDP2) or fp64. See ``thdpack.train.precision``."""
    seed: int = 0
    """Model initialisation and every other random choice of the run."""
    output_dir: str = "outputs/train"
    """metrics.jsonl, checkpoints/, loss.png, config.yaml go here."""
    resume: bool = False
    """Continue from the newest valid checkpoint in output_dir; damaged checkpoints are skipped with
    a warning naming the file. The checkpoint's data (the store's checksums), tokenizer and model
    settings must be this run's (a difference is refused, naming it). The layout may change (the
    processes, nodes, micro_batches, packs_per_micro_batch, DDP or FSDP, parallel.cp_size and the
    packing settings): the data stream continues from the checkpoint's position, the same packs in
    the same steps when the packs per step and the plan settings are unchanged, else the rest of
    the epoch planned again with the new settings (one line says what changed); the learning-rate
    schedule continues by steps."""
    resume_data_changed: bool = False
    """With resume: continue the checkpoint's model, optimizer and schedule on data (or a
    tokenizer) other than the checkpoint's; the data stream then starts at the new data's
    beginning. Without it such a resume is refused."""
    overwrite: bool = False
    """Delete the checkpoints an earlier run left in output_dir and start over (without it, a fresh
    run into an output_dir that holds checkpoints is refused)."""
    stop_at: int | None = None
    """Stop after this step and checkpoint (the schedule still spans ``steps``): split a run over
    time-limited allocations, then continue with train.resume=true."""
    checkpoint_every: int = 20
    """Save a checkpoint every N steps and at the end (0: only at the end)."""
    keep_checkpoints: int = 2
    """How many checkpoints to keep (the newest, the one just saved always among them)."""
    log_every: int = 1
    """Print a progress line every N steps (metrics.jsonl gets every step)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them
    (less memory, about one more forward of compute; the same losses and gradients)."""
    save_hf: bool = False
    """model=hf: write a Hugging Face folder (``hf/`` in the checkpoint) at every checkpoint; the
    last checkpoint always has one, copied to ``output_dir/hf`` at the end. Refused with thdpack's
    own model, which has no Hugging Face export."""
    prefetch_steps: int = 2
    """Steps planned, collated, CP-sharded (and pinned on CUDA) ahead in a background thread while
    the device trains (0: in the training loop, between steps)."""
    plot: bool = True
    """Write loss.png at the end (needs matplotlib)."""

    def __post_init__(self) -> None:
        _at_least("train.steps", self.steps, 1)
        _at_least("train.micro_batches", self.micro_batches, 1)
        _at_least("train.packs_per_micro_batch", self.packs_per_micro_batch, 1)
        _at_least("train.warmup_steps", self.warmup_steps, 0)
        _at_least("train.grad_clip", self.grad_clip, 0)
        _at_least("train.checkpoint_every", self.checkpoint_every, 0)
        _at_least("train.keep_checkpoints", self.keep_checkpoints, 1)
        _at_least("train.log_every", self.log_every, 1)
        _at_least("train.prefetch_steps", self.prefetch_steps, 0)
        if self.resume and self.overwrite:
            raise ValueError(
                "train.resume=true and train.overwrite=true contradict each other: resume continues the "
                "checkpoints in train.output_dir, overwrite deletes them; set one of them"
            )
        if self.resume_data_changed and not self.resume:
            raise ValueError("train.resume_data_changed=true applies to a resumed run: add train.resume=true")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise ValueError(f"train.stop_at must be in [1, train.steps={self.steps}], got {self.stop_at}")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            _finite(f"train.{name}", getattr(self, name))
        if not self.lr > 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= train.min_lr <= train.lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}")
        _at_least("train.weight_decay", self.weight_decay, 0)
        _one_of("train.loss_reduction", self.loss_reduction, LOSS_REDUCTIONS)
        _one_of("train.precision", self.precision, PRECISIONS)


MODEL_KINDS = ("thdpack", "hf")
ModelNode = hydra_node(
    ModelConfig,
    exclude=("attention",),  # the `attention` group sets it
    extra=(
        ("kind", str, "thdpack"),
        ("path", str | None, None),
        ("arch", str | None, None),
        ("trust_remote_code", bool, False),
    ),
    optional=True,
)
"""The ``model`` group: ``thdpack.models.ModelConfig``'s fields for thdpack's decoder
(``kind: thdpack``, the presets tiny / small / 114m), or with ``kind: hf`` a Hugging Face causal
LM (``configs/model/hf.yaml``: ``thdpack.models.hf.causal_lm.HFModelConfig``): ``path``, a local
folder (``trust_remote_code``: run the code it ships), or ``arch`` with the size fields for a
random initialisation."""
AttentionNode = hydra_node(AttentionConfig)


@dataclass(kw_only=True)
class Config:
    """The whole run: one node per group."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelNode = field(default_factory=ModelNode)  # type: ignore[valid-type]
    packing: PackingNode = field(default_factory=PackingNode)  # type: ignore[valid-type]
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    attention: AttentionNode = field(default_factory=AttentionNode)  # type: ignore[valid-type]
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        # the packing group, then the rule that spans it and the parallel group
        check_pack_size(self.packing_config.plan.pack_size, self.parallel.cp_size)
        self.model_config()  # validates the model and attention groups together
        if self.train.save_hf and self.model.kind != "hf":
            raise ValueError(
                f"train.save_hf=true writes a Hugging Face folder, which only model=hf runs have: thdpack's own "
                f"decoder (model.kind={self.model.kind}) has no transformers class to export to; drop train.save_hf, "
                "or train a transformers model (model=hf, e.g. model.arch=llama)"
            )

    def model_config(self) -> ModelConfig | HFModelConfig:
        """The model's component config: the model group, with the attention group's config."""
        _one_of("model.kind", self.model.kind, MODEL_KINDS)
        if self.model.kind == "hf":
            return build(HFModelConfig, self.model, attention=self.attention_config())
        hf_only = ("path", "arch", "trust_remote_code")
        stray = [f"model.{name}={_shown(getattr(self.model, name))}" for name in hf_only if getattr(self.model, name)]
        if stray:
            raise ValueError(f"{', '.join(stray)} applies to Hugging Face models only: add model=hf, or drop it")
        return build(ModelConfig, self.model, attention=self.attention_config())

    @functools.cached_property
    def packing_config(self) -> PackedDatasetConfig:
        """The data's component config, built (and checked) once from the packing group; the
        trainer passes the run's values beside it (``PackedDatasetConfig.build``)."""
        return build(PackedDatasetConfig, self.packing, flatten=PACKING_FLATTEN)

    def attention_config(self) -> AttentionConfig:
        return build(AttentionConfig, self.attention)


def register_configs() -> None:
    """Register the schema of the whole run and of every group in Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="train_schema", node=Config)
    for group, node in (
        ("data", DataConfig),
        ("model", ModelNode),
        ("packing", PackingNode),
        ("parallel", ParallelConfig),
        ("attention", AttentionNode),
        ("train", TrainConfig),
    ):
        store.store(group=group, name="schema", node=node)
