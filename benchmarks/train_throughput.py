"""Training throughput: thdpack's packed THD batches against padded batches of the same tokens.

    python benchmarks/train_throughput.py                          # GPU: 287M decoder, bf16-mixed, L 4096 and 8192
    python benchmarks/train_throughput.py --pack-sizes 4096 --steps 5 --out /tmp/tp
    python benchmarks/train_throughput.py --lengths my.lengths.npy  # any 1-D .npy of document lengths
    python benchmarks/train_throughput.py --cpu                    # CPU-sized: 5.2M decoder, L 1024 and 2048 (~10 min)
    python benchmarks/train_throughput.py --tiny                   # CPU, tiny model, seconds (the tests run this)
    python benchmarks/train_throughput.py --cp 2                   # CP end to end: te / adaptive / a2a, 2 processes

A Llama-style decoder (thdpack's ``Transformer``; on the GPU dim 1024, 20 layers, 16 query / 8
KV heads of 64, SwiGLU 2816, GPT-2's vocabulary, tied embeddings: 287M parameters) trains with
AdamW in bf16 mixed precision: fp32 parameters and optimizer state, the forward pass under
``torch.autocast(bfloat16)``, the loss in fp32, the optimizer step inside the timed step. On the
CPU (``--tiny``) the same code runs in fp32 by default (``--precision auto``): CPUs without bf16
matrix units emulate it 10-30x slower, which would measure the emulation, not the layout.

Each step trains on the same documents in every mode: lengths from real data (Alpaca records
under the GPT-2 tokenizer, short; the Python 3.11 standard library, long-tailed; or ``--lengths``),
documents longer than the pack split into pack-size pieces (counted), random token ids (speed does
not depend on them; every real token bears loss). Each step's documents are those of
``step_tokens / L`` random packs of one bfd plan of the whole dataset (how ``PackedDataset``
trains), in a random order. The modes lay them out differently and feed the SAME model as THD
batches, so only the layout differs:

- (a) ``padding``: Hugging Face's default collator: every example its own row, padded to the
  longest example of its micro-batch; ``B = ceil(documents / micro-batches)`` examples per
  micro-batch (the examples thdpack's packs hold), in the random order. A micro-batch over
  ``pad_cap * micro_tokens`` slots is cut into fewer rows per micro-batch (what a user short of
  memory does; counted in the micro-batch column).
- (b) ``grouped``: length-grouped dynamic padding, the best layout without packing: the step's
  documents sorted by length, cut into micro-batches of at most ``micro_tokens`` padded slots
  (grouping across steps would change the tokens of a step).
- (c) ``packed``: thdpack: the plan's packs (``plan_packs``, bfd), ``pack_from_segments``, ``thd_collate``;
  ``micro_tokens / L`` packs per micro-batch; attention by the fastest available backend (``auto``,
  logged).
- (d) ``concat``: naive concatenation without boundaries: the documents back to back, cut into
  rows of L, one causal sequence per row (documents attend to each other: contaminating, a speed
  reference only); the last row padded.
- (e) ``ideal``: the same tokens as full rows of single documents: rows of L real tokens, no
  padding (the last row shorter).

A padding mode's row is a slot of ``cu_seqlens_padded`` (width: the micro-batch's longest example)
with the real ``cu_seqlens``: padded tokens cost embedding, MLP, norm and LM-head work as in HF's
padded path; attention costs what the backend makes of real lengths (the varlen kernels skip
padding, as HF's FlashAttention-2 path does; HF's SDPA path would also pay attention on padding).

Reported per mode: real (loss-bearing) tokens per step (equal in every mode, checked), slots per
step, padding, micro-batches, step time (median of ``--steps`` timed steps after ``--warmup``;
the modes take turns step by step, so a shared machine's slow spells hit them alike), real
tokens/s, peak memory (``torch.cuda.max_memory_allocated``; '-' on CPU), MFU (GPU: ``6 * params *
real tokens`` plus ``12 * layers * heads * head_dim`` per real causal pair of the layout,
over NVIDIA's dense bf16 peak, 989 TFLOP/s for H100 SXM; '-' on CPU), the GPU's idle fraction
(one extra step under ``torch.profiler``: 1 - union of GPU kernel / copy intervals / wall time of
the step; '-' on CPU) and the host time to collate a step's batches. Host batches are built (and
pinned on CUDA) before the timed steps, as DataLoader workers with ``pin_memory=True`` deliver
them; the copy to the device (``thd_to_device``, non-blocking) is part of each step. Ratios c/a,
c/b, c/e of real tokens/s against the targets (>= 2.5, >= 1.3, >= 0.95) are marked met / missed.

Writes ``train_throughput.json``, ``train_throughput.md`` and ``train_throughput.png`` into
``--out``. Every number is measured on the device named next to it; nothing is estimated.

Legend: ``S`` documents of a step, ``R`` real tokens of a step (its documents back to back), ``T``
tokens of a THD batch, ``V`` vocabulary.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

from throughput_inputs import CPU_MODEL, DATASETS, SEED, TINY_MODEL, load_lengths, split_documents  # noqa: E402

from thdpack.cp.topology import CpTopology  # noqa: E402
from thdpack.layout.rules import IGNORE_INDEX  # noqa: E402
from thdpack.loss import StepLoss  # noqa: E402
from thdpack.models import ModelConfig, Transformer  # noqa: E402
from thdpack.packing.layout import position_ids  # noqa: E402
from thdpack.packing.packer import pack_from_segments  # noqa: E402
from thdpack.plan import plan_packs  # noqa: E402
from thdpack.thd import thd_collate, thd_to_device  # noqa: E402

Mode = Literal["padding", "grouped", "packed", "concat", "ideal"]
MODES: tuple[Mode, ...] = get_args(Mode)
MODE_LABELS: dict[Mode, str] = {
    "padding": "(a) dynamic padding",
    "grouped": "(b) length-grouped padding",
    "packed": "(c) thdpack packed THD",
    "concat": "(d) naive concat (contaminating)",
    "ideal": "(e) ideal full rows",
}
TARGETS: tuple[tuple[str, Mode, Mode, float], ...] = (
    ("c/a", "packed", "padding", 2.5),
    ("c/b", "packed", "grouped", 1.3),
    ("c/e", "packed", "ideal", 0.95),
)
"""(name, numerator, denominator, target): ratios of real tokens/s the issue asks for."""
Precision = Literal["auto", "bf16-mixed", "fp32"]
PRECISIONS: tuple[Precision, ...] = get_args(Precision)

GPU_MODEL = ModelConfig(vocab_size=50257, dim=1024, n_layers=20, n_heads=16, n_kv_heads=8, ffn_dim=2816)
"""287M parameters: Llama-style, GPT-2 vocabulary, tied embeddings."""
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
)
"""Dense bf16 tensor-core peaks (NVIDIA datasheets), matched in order against the device name."""

Seq = tuple[int, int, int]
"""One sequence of a layout: (start in the step's token stream, real tokens, slot width)."""


@dataclass(frozen=True, kw_only=True)
class ThroughputConfig:
    """One benchmark run: the model, the layouts' sizes and the timing protocol."""

    model: ModelConfig = GPU_MODEL
    """The decoder; its attention backend stays ``auto`` unless set here."""
    pack_sizes: tuple[int, ...] = (4096, 8192)
    """L: pack size of (c), row length of (d) / (e), and the longest document piece."""
    micro_tokens: int = 8192
    """Slots of one micro-batch in (c), (d), (e) (``micro_tokens / L`` rows) and the most in one of (b)."""
    step_tokens: int = 32768
    """Token capacity of an optimizer step: ``step_tokens / L`` packs, ``step_tokens / micro_tokens`` micro-batches."""
    warmup: int = 2
    """Untimed steps per mode before the timed ones."""
    steps: int = 8
    """Timed steps per mode (median reported)."""
    pad_cap: float = 3.0
    """(a) cuts a micro-batch of more than ``pad_cap * micro_tokens`` slots into fewer rows each."""
    precision: Precision = "auto"
    """``bf16-mixed`` (fp32 weights, bf16 autocast), ``fp32``, or ``auto``: bf16-mixed on CUDA, fp32 on CPU."""
    lr: float = 3e-4
    """AdamW learning rate (the speed does not depend on it)."""
    seed: int = SEED
    """Seeds the document order, the token ids and the weights."""
    profile: bool = True
    """On CUDA, profile one extra step per mode for the GPU idle fraction."""

    def __post_init__(self) -> None:
        for name in ("micro_tokens", "step_tokens", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {self.warmup!r}")
        if not self.pack_sizes:
            raise ValueError("pack_sizes is empty; give at least one pack size, e.g. (4096, 8192)")
        for pack_size in self.pack_sizes:
            if isinstance(pack_size, bool) or not isinstance(pack_size, int) or pack_size < 1:
                raise ValueError(f"pack sizes must be ints >= 1, got {pack_size!r}")
            if self.micro_tokens % pack_size:
                raise ValueError(
                    f"micro_tokens={self.micro_tokens} is not a multiple of pack size {pack_size}; a micro-batch "
                    f"holds whole packs: use micro_tokens={-(-self.micro_tokens // pack_size) * pack_size}"
                )
        if self.step_tokens % self.micro_tokens:
            raise ValueError(
                f"step_tokens={self.step_tokens} is not a multiple of micro_tokens={self.micro_tokens}; a step "
                "is a whole number of micro-batches"
            )
        if not self.pad_cap >= 1:
            raise ValueError(f"pad_cap must be >= 1 (a multiple of micro_tokens), got {self.pad_cap}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; valid: {', '.join(PRECISIONS)}")

    @property
    def micro_batches(self) -> int:
        """G: micro-batches of an optimizer step in the packed mode."""
        return self.step_tokens // self.micro_tokens


TINY = ThroughputConfig(model=TINY_MODEL, pack_sizes=(128, 256), micro_tokens=256, step_tokens=512, warmup=1, steps=5)
"""``--tiny``: seconds on a CPU."""
CPU = ThroughputConfig(model=CPU_MODEL, pack_sizes=(1024, 2048), micro_tokens=4096, step_tokens=8192, warmup=1, steps=4)
"""``--cpu``: the same comparison sized for a CPU (about 10 minutes on 2 cores); the GPU sizes
(287M parameters, L 4096 / 8192) would take hours there."""


# ---------------------------------------------------------------------------------------------
# Data: lengths, steps, layouts


@dataclass(frozen=True)
class Step:
    """One optimizer step's documents, which every mode trains on."""

    lengths_S: np.ndarray
    """(S,) int64 document lengths in stream order (a random order, as a sampler yields them)."""
    packs: tuple[np.ndarray, ...]
    """The packed mode's packs: indices into ``lengths_S``, in placement order."""


def plan_step(lengths_S: np.ndarray, pack_size: int) -> Step:
    """A step of exactly these documents, packed by their own bfd plan.

    >>> [p.tolist() for p in plan_step(np.array([3, 6, 2, 4]), 8).packs]
    [[3, 0], [1, 2]]
    """
    plan = plan_packs(lengths_S, pack_size, algorithm="bfd")
    return Step(np.asarray(lengths_S, dtype=np.int64), tuple(plan[i] for i in range(len(plan))))


def draw_steps(pieces_S: np.ndarray, pack_size: int, packs: int, count: int, rng: np.random.Generator) -> list[Step]:
    """``count`` steps of ``packs`` packs each, drawn at random from ONE bfd plan of all of
    ``pieces_S`` (how ``PackedDataset`` trains: plan the epoch, shuffle its packs; a plan per step
    would waste the tail of every step's last pack). A step's documents are its packs' documents
    in a random order; an epoch with too few packs is reused, reshuffled."""
    plan = plan_packs(pieces_S, pack_size, algorithm="bfd")
    if len(plan) < packs:
        raise ValueError(
            f"the lengths fill {len(plan)} packs of {pack_size} tokens, fewer than the {packs} of one step; "
            "use a smaller step_tokens or a larger lengths file"
        )
    need = count * packs
    order = np.concatenate([rng.permutation(len(plan)) for _ in range(-(-need // len(plan)))])[:need]
    steps = []
    for k in range(count):
        members = [plan[int(i)] for i in order[k * packs : (k + 1) * packs]]
        stream = rng.permutation(sum(len(m) for m in members))  # stream position of each member entry
        bounds = np.cumsum([0] + [len(m) for m in members])
        lengths_S = np.empty(len(stream), dtype=np.int64)
        lengths_S[stream] = pieces_S[np.concatenate(members)]
        steps.append(Step(lengths_S, tuple(stream[a:b] for a, b in itertools.pairwise(bounds))))
    return steps


def step_tokens(lengths_S: np.ndarray, vocab_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``(ids_R, labels_R)``: the step's documents back to back as one stream of R real tokens,
    random ids in ``[1, vocab)`` (0 is the pad id) and random labels (every real token bears loss)."""
    total = int(lengths_S.sum())
    return rng.integers(1, vocab_size, total), rng.integers(1, vocab_size, total)


def layout(mode: Mode, lengths_S: np.ndarray, pack_size: int, cfg: ThroughputConfig) -> list[list[Seq]]:
    """A step's micro-batches in ``mode`` (not ``packed``, which ``plan_packs`` lays out): lists of
    (stream start, real tokens, slot width), documents in stream order ``lengths_S``.

    >>> cfg = ThroughputConfig(model=TINY_MODEL, pack_sizes=(8,), micro_tokens=8, step_tokens=16)
    >>> layout("padding", np.array([3, 5, 2, 4]), 8, cfg)      # 2 examples per micro-batch
    [[(0, 3, 5), (3, 5, 5)], [(8, 2, 4), (10, 4, 4)]]
    >>> layout("grouped", np.array([3, 5, 2, 4]), 8, cfg)      # sorted, at most 8 slots each
    [[(3, 5, 5)], [(10, 4, 4), (0, 3, 4)], [(8, 2, 2)]]
    >>> layout("concat", np.array([3, 5, 2, 4]), 8, cfg), layout("ideal", np.array([3, 5, 2, 4]), 8, cfg)
    ([[(0, 8, 8)], [(8, 6, 8)]], [[(0, 8, 8)], [(8, 6, 6)]])
    """
    starts_S = np.cumsum(lengths_S) - lengths_S
    if mode == "padding":
        per_micro = -(-len(lengths_S) // cfg.micro_batches)
        cap = int(cfg.pad_cap * cfg.micro_tokens)
        micro = []
        for first in range(0, len(lengths_S), per_micro):
            group = np.arange(first, min(first + per_micro, len(lengths_S)))
            rows_fit = max(1, cap // int(lengths_S[group].max()))
            for part in np.array_split(group, -(-len(group) // rows_fit)):
                width = int(lengths_S[part].max())
                micro.append([(int(starts_S[s]), int(lengths_S[s]), width) for s in part])
        return micro
    if mode == "grouped":
        order = np.argsort(-lengths_S, kind="stable")
        micro, i = [], 0
        while i < len(order):
            width = int(lengths_S[order[i]])
            part = order[i : i + max(1, cfg.micro_tokens // width)]
            micro.append([(int(starts_S[s]), int(lengths_S[s]), width) for s in part])
            i += len(part)
        return micro
    if mode in ("concat", "ideal"):
        total = int(lengths_S.sum())
        rows = [(start, min(pack_size, total - start)) for start in range(0, total, pack_size)]
        per_micro = cfg.micro_tokens // pack_size
        return [
            [(start, n, pack_size if mode == "concat" else n) for start, n in rows[i : i + per_micro]]
            for i in range(0, len(rows), per_micro)
        ]
    raise ValueError(f"layout() lays out {[m for m in MODES if m != 'packed']}, got {mode!r}")


def seqs_batch(seqs: Sequence[Seq], ids_R: np.ndarray, labels_R: np.ndarray) -> dict[str, Any]:
    """The THD batch of one micro-batch of :func:`layout`: each sequence's real tokens first in its
    slot, then pad id 0 / label -100 (one pack of all the slots; its THD batch equals the stacked rows')."""
    real_S = np.array([n for _, n, _ in seqs], dtype=np.int64)
    width_S = np.array([w for _, _, w in seqs], dtype=np.int64)
    within = np.arange(int(real_S.sum())) - np.repeat(np.cumsum(real_S) - real_S, real_S)
    source = np.repeat(np.array([s for s, _, _ in seqs], dtype=np.int64), real_S) + within
    target = np.repeat(np.cumsum(width_S) - width_S, real_S) + within
    input_ids = np.zeros(int(width_S.sum()), dtype=np.int64)
    labels = np.full(int(width_S.sum()), IGNORE_INDEX, dtype=np.int64)
    input_ids[target], labels[target] = ids_R[source], labels_R[source]
    pack = {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(position_ids(width_S)),
        "seq_lens": torch.from_numpy(real_S),
        "seq_lens_padded": torch.from_numpy(width_S),
    }
    return thd_collate([pack])


def micro_batches(
    mode: Mode, step: Step, ids_R: np.ndarray, labels_R: np.ndarray, pack_size: int, cfg: ThroughputConfig
) -> list[dict[str, Any]]:
    """One step's host THD batches in ``mode`` (the packed mode through thdpack's own pipeline)."""
    lengths_S = step.lengths_S
    if mode != "packed":
        return [seqs_batch(seqs, ids_R, labels_R) for seqs in layout(mode, lengths_S, pack_size, cfg)]
    starts_S = np.cumsum(lengths_S) - lengths_S
    samples = [
        {"input_ids": ids_R[s : s + n], "labels": labels_R[s : s + n]} for s, n in zip(starts_S, lengths_S, strict=True)
    ]
    segments = [(members, np.zeros(len(members), dtype=np.int64), lengths_S[members]) for members in step.packs]
    packs = [pack_from_segments(samples, segment, pack_size) for segment in segments]
    per_micro = cfg.micro_tokens // pack_size
    return [thd_collate(packs[i : i + per_micro]) for i in range(0, len(packs), per_micro)]


def batch_counts(batch: Mapping[str, Any]) -> dict[str, int]:
    """Real (loss-bearing) tokens, slots and real causal (query, key) pairs of a host THD batch."""
    real_S = torch.diff(batch["cu_seqlens"]).to(torch.int64)
    return {
        "real": int((batch["labels"] != IGNORE_INDEX).sum()),
        "slots": int(batch["input_ids"].numel()),
        "pairs": int((real_S * (real_S + 1) // 2).sum()),
    }


# ---------------------------------------------------------------------------------------------
# Measurement


def resolve_precision(precision: Precision, device: torch.device) -> Literal["bf16-mixed", "fp32"]:
    if precision == "auto":
        return "bf16-mixed" if device.type == "cuda" else "fp32"
    return precision


def train_step(
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    host_batches: Sequence[Mapping[str, Any]],
    device: torch.device,
    precision: Literal["bf16-mixed", "fp32"],
) -> torch.Tensor:
    """One optimizer step over the micro-batches: copy, forward (autocast), fp32 loss, backward,
    AdamW. Returns the step's loss as a device tensor (reading it would sync the device)."""
    batches = [thd_to_device(b, device) for b in host_batches]
    step_loss = StepLoss.begin([b["labels"] for b in batches], topology=CpTopology.single())
    for batch in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            logits_TV = model(batch)
        step_loss(logits_TV, batch["labels"]).backward()  # cross-entropy upcasts bf16 logits to fp32
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return step_loss.value()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def busy_seconds(intervals_us: Sequence[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals in microseconds, in seconds.

    >>> busy_seconds([(0, 10), (5, 20), (30, 31)]) * 1e6
    21.0
    """
    busy, reach = 0.0, -math.inf
    for start, end in sorted(intervals_us):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy / 1e6


def device_intervals(events: Sequence[Any], device_type: Any) -> list[tuple[float, float]]:
    """``(start, end)`` microseconds of the profiler events that ran on ``device_type`` (kernels,
    copies, memsets: the GPU's own activity, not the host calls that launched them)."""
    return [(e.time_range.start, e.time_range.end) for e in events if e.device_type == device_type]


def gpu_idle_fraction(run_step: Any, device: torch.device) -> float:
    """1 - (union of the GPU's kernel and copy intervals) / (wall time) of one profiled step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run_step()
        _sync(device)
        wall = time.perf_counter() - start
    intervals = device_intervals(prof.events(), DeviceType.CUDA)
    if not intervals:
        raise RuntimeError("the profiler recorded no GPU activity (is CUPTI available?)")
    return max(0.0, 1.0 - busy_seconds(intervals) / wall)


def step_flops(model: Transformer, real_tokens: int, pairs: int) -> int:
    """Model FLOPs of one training step (forward + backward) on its useful work only.

    ``6 * parameters * real_tokens`` for the matmuls (the tied embedding counted once: it is the LM
    head's matmul; the lookup is free) plus ``12 * layers * heads * head_dim`` per real causal
    (query, key) pair for QK^T and PV. Padding costs time but no model FLOPs.
    """
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    return 6 * params * real_tokens + 12 * c.n_layers * c.n_heads * c.head_dim * pairs


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of the device in FLOP/s, None where unknown (MFU is then not reported)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


def measure_modes(
    host_steps: Mapping[Mode, Sequence[Sequence[Mapping[str, Any]]]],
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    cfg: ThroughputConfig,
) -> dict[Mode, dict[str, Any]]:
    """Train every mode's steps, interleaved (step i of every mode, in an order that rotates with i,
    before step i+1), so that a shared machine's slow spells and the model's state hit all modes
    alike. The first ``cfg.warmup`` steps are untimed. A mode that fails (out of memory, a kernel
    error) gets a ``failed`` row; the others go on. Then memory, MFU and the GPU idle fraction."""
    precision = resolve_precision(cfg.precision, device)
    modes = list(host_steps)
    seconds: dict[Mode, list[float]] = {m: [] for m in modes}
    peak_memory: dict[Mode, int] = dict.fromkeys(modes, 0)
    losses: dict[Mode, torch.Tensor] = {}
    failed: dict[Mode, str] = {}
    for i in range(cfg.warmup + cfg.steps):
        for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
            if mode in failed:
                continue
            try:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                _sync(device)
                start = time.perf_counter()
                losses[mode] = train_step(model, optimizer, host_steps[mode][i], device, precision)
                _sync(device)
                seconds[mode].append(time.perf_counter() - start)
                if device.type == "cuda":
                    peak_memory[mode] = max(peak_memory[mode], torch.cuda.max_memory_allocated(device))
            except Exception as err:  # this mode's row reports it; the other modes go on
                optimizer.zero_grad(set_to_none=True)
                failed[mode] = f"{type(err).__name__}: {err}"
    rows = {}
    for mode in modes:
        if mode in failed:
            rows[mode] = {"mode": mode, "failed": failed[mode]}
            continue
        rows[mode] = _mode_row(mode, host_steps[mode], seconds[mode], losses[mode], model, device, cfg)
        rows[mode]["peak_memory_bytes"] = peak_memory[mode] if device.type == "cuda" else None
        if device.type == "cuda" and cfg.profile:
            step = host_steps[mode][cfg.warmup]
            try:
                rows[mode]["gpu_idle"] = gpu_idle_fraction(
                    lambda step=step: train_step(model, optimizer, step, device, precision), device
                )
            except Exception as err:  # the idle fraction is one column; the mode's timings stand
                rows[mode]["gpu_idle_error"] = f"{type(err).__name__}: {err}"
    return rows


def _mode_row(
    mode: Mode,
    host_steps: Sequence[Sequence[Mapping[str, Any]]],
    seconds: Sequence[float],
    loss: torch.Tensor,
    model: Transformer,
    device: torch.device,
    cfg: ThroughputConfig,
) -> dict[str, Any]:
    timed = slice(cfg.warmup, None)
    counts = [[batch_counts(b) for b in step] for step in host_steps[timed]]
    real = [sum(c["real"] for c in step) for step in counts]
    slots = [sum(c["slots"] for c in step) for step in counts]
    pairs = [sum(c["pairs"] for c in step) for step in counts]
    seconds = seconds[timed]
    row: dict[str, Any] = {
        "mode": mode,
        "real_tokens_per_step": real,
        "slots_per_step": slots,
        "micro_batches_per_step": [len(step) for step in host_steps[timed]],
        "padding": 1 - sum(real) / sum(slots),
        "step_seconds": seconds,
        "step_time_s": statistics.median(seconds),
        "tokens_per_s": statistics.median(r / s for r, s in zip(real, seconds, strict=True)),
        "final_loss": float(loss),
        "mfu": None,
        "gpu_idle": None,
    }
    if not math.isfinite(row["final_loss"]):
        raise FloatingPointError(f"mode {mode}: the loss is {row['final_loss']} after {len(host_steps)} steps")
    peak = peak_flops(device)
    if peak is not None:
        flops = [step_flops(model, r, p) for r, p in zip(real, pairs, strict=True)]
        row["mfu"] = statistics.median(f / s / peak for f, s in zip(flops, seconds, strict=True))
    return row


class _Records(logging.Handler):
    """Collects the attention backend choices ``thdpack.attention`` logs (once per situation)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message not in self.messages:
            self.messages.append(message)


def _pin(batch: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def run(
    datasets: Mapping[str, Path], cfg: ThroughputConfig, device: torch.device, *, say: Any = print
) -> dict[str, Any]:
    """Measure every mode for every dataset and pack size; returns the results (see ``write``)."""
    records = _Records()
    attention_log = logging.getLogger("thdpack.attention")
    attention_log.addHandler(records)
    old_level = attention_log.level
    attention_log.setLevel(logging.INFO)
    precision = resolve_precision(cfg.precision, device)
    result: dict[str, Any] = {
        "device": device.type,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "threads": torch.get_num_threads(),
        "precision": precision,
        "config": asdict(cfg),
        "runs": [],
        "skipped": [],
    }
    try:
        model = Transformer(cfg.model, seed=cfg.seed, device=device)  # fp32 parameters in every precision
        result["parameters"] = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=device.type == "cuda")
        for data, path in datasets.items():
            if not path.exists():
                reason = (
                    f"{path} is absent (only the project's own checkout has ../shared; THDPACK_SHARED_DATA overrides)"
                )
                say(f"skipping {data}: {reason}")
                result["skipped"].append({"data": data, "reason": reason})
                continue
            documents, empty = load_lengths(path)
            for pack_size in cfg.pack_sizes:
                result["runs"].append(_run_one(data, documents, empty, pack_size, model, optimizer, device, cfg, say))
    finally:
        attention_log.removeHandler(records)
        attention_log.setLevel(old_level)
    result["attention"] = records.messages or ["auto (its choice was logged earlier in this process)"]
    return result


def _run_one(
    data: str,
    documents: np.ndarray,
    empty: int,
    pack_size: int,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    cfg: ThroughputConfig,
    say: Any,
) -> dict[str, Any]:
    pieces, split = split_documents(documents, pack_size)
    rng = np.random.default_rng(cfg.seed)
    steps = draw_steps(pieces, pack_size, cfg.step_tokens // pack_size, cfg.warmup + cfg.steps, rng)
    tokens = [step_tokens(step.lengths_S, cfg.model.vocab_size, rng) for step in steps]
    say(
        f"{data}, L={pack_size}: {len(documents)} documents ({empty} empty left out, {split} longer than L split "
        f"into pieces), {statistics.mean(len(s.lengths_S) for s in steps):.1f} documents per step"
    )
    run_row: dict[str, Any] = {"data": data, "pack_size": pack_size, "empty_documents": empty, "split_documents": split}
    host_steps: dict[Mode, list[list[dict[str, Any]]]] = {}
    collate_s: dict[Mode, float] = {}
    for mode in MODES:
        start = time.perf_counter()
        host_steps[mode] = [micro_batches(mode, s, *t, pack_size, cfg) for s, t in zip(steps, tokens, strict=True)]
        collate_s[mode] = (time.perf_counter() - start) / len(steps)
        if device.type == "cuda":
            host_steps[mode] = [[_pin(b) for b in step] for step in host_steps[mode]]
    modes = measure_modes(host_steps, model, optimizer, device, cfg)
    for mode, row in modes.items():
        row["collate_s_per_step"] = collate_s[mode]
        say(_text_row(data, pack_size, row, result_device(device)))
    real = {tuple(r["real_tokens_per_step"]) for r in modes.values() if "failed" not in r}
    assert len(real) <= 1, f"modes trained on different real tokens per step: {real}"
    run_row["modes"] = modes
    run_row["ratios"] = ratios(modes)
    return run_row


def result_device(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "cpu"


def ratios(modes: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """c/a, c/b, c/e of real tokens/s with their targets; None where a mode failed."""
    out = {}
    for name, top, bottom, target in TARGETS:
        if "tokens_per_s" in modes[top] and "tokens_per_s" in modes[bottom]:
            value = modes[top]["tokens_per_s"] / modes[bottom]["tokens_per_s"]
            out[name] = {"value": value, "target": target, "met": value >= target}
        else:
            out[name] = {"value": None, "target": target, "met": None}
    return out


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's architecture and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


# ---------------------------------------------------------------------------------------------
# Reports

HEADER = (
    "| data | L | mode | device | real tok/step | slots/step | padding | micro-batches | step ms | real tok/s "
    "| peak mem GiB | MFU | GPU idle | collate ms/step |"
)


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _cells(data: str, pack_size: int, row: Mapping[str, Any], device: str) -> list[str]:
    label = MODE_LABELS[row["mode"]]
    collate = _fmt(row.get("collate_s_per_step"), ".1f", 1e3)
    if "failed" in row:
        return [data, str(pack_size), label, device, f"failed: {row['failed'][:80]}", *["-"] * 8, collate]
    idle = _fmt(row["gpu_idle"], ".1%") if "gpu_idle_error" not in row else "error"
    return [
        data,
        str(pack_size),
        label,
        device,
        f"{statistics.mean(row['real_tokens_per_step']):,.0f}",
        f"{statistics.mean(row['slots_per_step']):,.0f}",
        f"{row['padding']:.1%}",
        f"{statistics.mean(row['micro_batches_per_step']):.1f}",
        f"{row['step_time_s'] * 1e3:,.1f}",
        f"{row['tokens_per_s']:,.0f}",
        _fmt(row["peak_memory_bytes"], ".2f", 2.0**-30),
        _fmt(row["mfu"], ".1%"),
        idle,
        collate,
    ]


def _text_row(data: str, pack_size: int, row: Mapping[str, Any], device: str) -> str:
    return "| " + " | ".join(_cells(data, pack_size, row, device)) + " |"


def markdown(result: Mapping[str, Any]) -> str:
    """The results as markdown: the hardware line, the per-mode table and the ratio table."""
    device = result["device"]
    lines = [
        f"Measured on {result['device_name']} ({device}), torch {result['torch']}, {result['precision']}, "
        f"{result.get('parameters', 0) / 1e6:.1f}M-parameter decoder "
        f"(dim {result['config']['model']['dim']}, {result['config']['model']['n_layers']} layers), "
        f"{result['config']['step_tokens']:,} token slots per step in {result['config']['micro_tokens']:,}-slot "
        f"micro-batches; medians of {result['config']['steps']} timed steps after {result['config']['warmup']} "
        "warm-up steps.",
        "",
        f"Attention: {'; '.join(result.get('attention', []))}",
        "",
        HEADER,
        "|" + "---|" * (HEADER.count("|") - 1),
    ]
    for run_row in result["runs"]:
        for row in run_row["modes"].values():
            lines.append(_text_row(run_row["data"], run_row["pack_size"], row, device))
    lines += ["", "| data | L | device | " + " | ".join(f"{n} (target >= {t})" for n, _, _, t in TARGETS) + " |"]
    lines.append("|" + "---|" * (3 + len(TARGETS)))
    for run_row in result["runs"]:
        cells = []
        for name, *_ in TARGETS:
            r = run_row["ratios"][name]
            cells.append(
                "not measured" if r["value"] is None else f"{r['value']:.3f} {'met' if r['met'] else 'missed'}"
            )
        lines.append(f"| {run_row['data']} | {run_row['pack_size']} | {device} | " + " | ".join(cells) + " |")
    for skip in result["skipped"]:
        lines.append(f"\nSkipped {skip['data']}: {skip['reason']}")
    return "\n".join(lines) + "\n"


def plot(result: Mapping[str, Any], path: Path) -> str | None:
    """A PNG of real tokens/s per mode for every (data, L); returns why not when it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        return f"no plot: matplotlib is not installed ({err})"
    runs = result["runs"]
    if not runs:
        return "no plot: nothing was measured"
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(runs)), 4.0))
    width = 0.8 / len(MODES)
    for m, mode in enumerate(MODES):
        values = [r["modes"][mode].get("tokens_per_s", 0.0) for r in runs]
        ax.bar([i + (m - 2) * width for i in range(len(runs))], values, width, label=MODE_LABELS[mode])
    ax.set_xticks(range(len(runs)), [f"{r['data']}\nL={r['pack_size']}" for r in runs])
    ax.set_ylabel(f"real tokens/s ({result['device']})")
    ax.set_title(f"Training throughput per layout: {result['device_name']}, {result['precision']}", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return None


def write(result: dict[str, Any], out: Path, stem: str = "train_throughput") -> list[Path]:
    """``stem``.json, .md and .png (when matplotlib is there) in ``out``; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    problem = plot(result, out / f"{stem}.png")
    if problem is None:
        paths.append(out / f"{stem}.png")
    else:
        result["plot"] = problem
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(markdown(result))
    return paths


# ---------------------------------------------------------------------------------------------


def choose_device(requested: str, tiny: bool) -> torch.device:
    """``cuda`` when available (``auto``), else the CPU, which only ``--tiny`` (or an explicit
    ``--device cpu``) measures: the 287M model would take hours there."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if not tiny:
            raise SystemExit(
                "no CUDA device: the full benchmark trains a 287M-parameter model; use --tiny on a CPU "
                "(or --device cpu to insist)"
            )
        return torch.device("cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA device")
    return torch.device(requested)


def config_from_args(args: argparse.Namespace) -> ThroughputConfig:
    cfg = TINY if args.tiny else CPU if args.cpu else ThroughputConfig()
    changes: dict[str, Any] = {}
    for name in ("micro_tokens", "step_tokens", "warmup", "steps", "pad_cap", "precision"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.pack_sizes is not None:
        changes["pack_sizes"] = tuple(args.pack_sizes)
    if args.no_profile:
        changes["profile"] = False
    return replace(cfg, **changes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny model, L 128 / 256, on the CPU (seconds)")
    parser.add_argument("--cpu", action="store_true", help="a 5.2M model, L 1024 / 2048, on the CPU (~10 min)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--lengths", type=Path, nargs="+", default=None, help="lengths files (default: alpaca, stdlib)")
    parser.add_argument("--pack-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--micro-tokens", type=int, default=None)
    parser.add_argument("--step-tokens", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--pad-cap", type=float, default=None)
    parser.add_argument("--precision", choices=PRECISIONS, default=None)
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled step (no GPU idle column)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1: steadier on a shared CPU)"
    )
    parser.add_argument(
        "--cp",
        type=int,
        default=None,
        help="end-to-end CP mode: te vs adaptive vs a2a on cp processes (cp_throughput.py)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.cp is not None:
        return _cp_mode(args)
    cfg = config_from_args(args)
    device = choose_device("cpu" if args.cpu and args.device == "auto" else args.device, args.tiny)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    datasets = DATASETS if args.lengths is None else {p.name.split(".")[0]: p for p in args.lengths}
    start = time.perf_counter()
    print(HEADER)
    result = run(datasets, cfg, device)
    result["wall_s"] = time.perf_counter() - start
    paths = write(result, args.out)
    print()
    print(markdown(result))
    print(f"wrote {', '.join(str(p) for p in paths)} in {result['wall_s']:.1f} s")
    if "plot" in result:
        print(result["plot"])
    return 0


def _cp_mode(args: argparse.Namespace) -> int:
    """``--cp N``: benchmarks/cp_throughput.py with the options both scripts know."""
    import cp_throughput  # imports this module; loaded only for this mode

    argv = ["--cp", str(args.cp), "--out", str(args.out), "--device", "cuda" if args.device == "cuda" else "cpu"]
    argv += ["--tiny"] if args.tiny else []
    argv += ["--lengths", *map(str, args.lengths)] if args.lengths else []
    argv += ["--pack-size", str(args.pack_sizes[0])] if args.pack_sizes else []
    for name in ("warmup", "steps"):
        if getattr(args, name) is not None:
            argv += [f"--{name}", str(getattr(args, name))]
    return cp_throughput.main(argv)


if __name__ == "__main__":
    sys.exit(main())
