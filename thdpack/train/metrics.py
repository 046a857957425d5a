"""What a run reports: metrics.jsonl (one JSON object per step), a log line per step, a summary,
and loss.png. Only the main rank writes; the numbers are global (all ranks)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from thdpack._optional import has_module
from thdpack.plan.packing_stats import PackingStats


@dataclass(frozen=True)
class StepMetrics:
    step: int
    epoch: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    """Real (non-padding) tokens of the step, all ranks."""
    loss_tokens: int
    """Tokens with a label (what the loss averages over)."""
    capacity: int
    """Token slots processed (packs x pack_size)."""
    sequences: int
    efficiency: float
    """tokens / capacity."""
    tokens_per_s: float
    """Useful (real) tokens per second of wall time, all ranks together."""
    step_seconds: float
    imbalance_tokens: float
    imbalance_attention: float
    data_wait_seconds: float = 0.0
    """How long the step waited for its batches from the prefetch thread (host stall)."""
    packs_sha256: str = ""
    """The step's packs, all ranks' (``Step.packs_sha256``): runs that train the same packs in a
    step log the same digest, whatever their data-parallel layout."""

    def line(self, steps: int) -> str:
        return (
            f"step {self.step:>{len(str(steps))}}/{steps} | loss {self.loss:.4f} | lr {self.lr:.2e} | "
            f"{self.tokens_per_s:,.0f} tok/s | eff {100 * self.efficiency:.1f}% | "
            f"DP imbalance {self.imbalance_attention:.2f} | {self.step_seconds:.2f} s"
        )


class MetricsLog:
    """Appends to ``metrics.jsonl``; on resume keeps the lines up to the resumed step."""

    def __init__(self, path: Path, *, resume_step: int | None) -> None:
        self.path = path
        kept: list[str] = []
        if resume_step is not None and path.exists():
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= resume_step]
        path.write_text("".join(f"{line}\n" for line in kept))
        self.history: list[dict[str, Any]] = [json.loads(line) for line in kept]

    def write(self, metrics: StepMetrics) -> None:
        record = asdict(metrics)
        self.history.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def padding_comparison(lengths: np.ndarray, stats: PackingStats) -> str:
    """What packing saves over the usual unpacked batch: one document per pack_size row, padded
    (and truncated when longer)."""
    size = stats.pack_size
    tokens = int(lengths.sum())
    kept = int(np.minimum(lengths, size).sum())
    slots = len(lengths) * size
    return (
        f"one document per {size}-token row: {len(lengths):,} rows, {100 * (1 - kept / slots):.1f}% of the slots "
        f"padding, {tokens - kept:,} tokens ({100 * (tokens - kept) / tokens:.1f}%) truncated away\n"
        f"packed: {stats.num_packs:,} rows, {100 * (1 - stats.efficiency):.2f}% padding "
        f"({stats.cp_padding_tokens:,} for CP divisibility); {stats.removed()}"
    )


def summary(history: list[dict[str, Any]], *, wall_seconds: float, stats: PackingStats) -> str:
    """The end-of-run report: loss, throughput, packing efficiency of the trained steps, and what the
    overflow policy removed from every epoch (``stats``: an epoch's ``PackingStats``; the policy
    removes the same from each, as it depends on the lengths only)."""
    if not history:
        return "no steps were run"
    tokens = sum(r["tokens"] for r in history)
    capacity = sum(r["capacity"] for r in history)
    busy = sum(r["step_seconds"] for r in history)
    return "\n".join(
        [
            f"steps {history[0]['step']}-{history[-1]['step']}: loss {history[0]['loss']:.4f} -> "
            f"{history[-1]['loss']:.4f}",
            f"trained on {tokens:,} real tokens in {sum(r['sequences'] for r in history):,} sequences; "
            f"wall time {wall_seconds:.1f} s",
            f"useful tokens/s: {tokens / busy:,.0f} (training steps only, all ranks)",
            f"packing efficiency of the trained steps: {100 * tokens / capacity:.2f}% of {capacity:,} token slots "
            f"held real tokens (padding waste avoided: see the comparison at the start)",
            f"packing.overflow, in every epoch: {stats.removed()}",
        ]
    )


def plot_loss(history: list[dict[str, Any]], path: Path) -> bool:
    """Write the loss curve; False when matplotlib is missing."""
    if not history or not has_module("matplotlib"):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in history], [r["loss"] for r in history])
    ax.set(xlabel="step", ylabel="loss (global token mean)", title="Training loss")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True
