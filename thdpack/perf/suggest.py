"""``thdpack plan --suggest``: the dp x cp, placement and K/V exchange to train a lengths file with.

Every option the GPUs allow is planned as the trainer plans it and timed by the step model; options
are ranked by real tokens per second per GPU. The command is ``thdpack.data.plan_command``.
"""

from __future__ import annotations

import numpy as np

from thdpack.perf.modes import mode_run
from thdpack.perf.shape import ModelShape
from thdpack.perf.step import PARTS, StepModel


def options(gpus: int, shape: ModelShape, longest: int, rank_tokens: int) -> list[tuple[str, int, str]]:
    """``(mode, cp, K/V exchange)`` of every option for ``gpus`` GPUs; a CP size must divide the
    GPUs and hold the longest sequence in one pack.

    >>> from thdpack.perf.shape import NAMED_SHAPES
    >>> options(8, NAMED_SHAPES["llama3-8b"], longest=20000, rank_tokens=8192)[:3]
    [('te', 4, 'ring'), ('te', 4, 'allgather'), ('adaptive', 4, 'ring')]
    """
    out = []
    cp = 1
    while cp <= gpus:
        if gpus % cp == 0 and longest <= cp * rank_tokens:
            if cp == 1:
                out.append(("te", 1, "none"))
            elif cp < gpus:
                for mode in ("te", "adaptive"):
                    out += [(mode, cp, "ring"), (mode, cp, "allgather")]
                if shape.heads % cp == 0:
                    out.append(("a2a", cp, "a2a"))
                out.append(("auto", cp, "ring"))
        cp *= 2
    if gpus > 1 and longest <= gpus * rank_tokens:
        out += [("mesh", gpus, "ring"), ("mesh", gpus, "allgather")]
        if shape.heads % gpus == 0:
            out.append(("a2a", gpus, "a2a"))
    return out


def suggest(
    lengths: np.ndarray, model: StepModel, *, gpus: int, rank_tokens: int, micro_batches: int
) -> list[dict[str, object]]:
    """Every option's modelled numbers, fastest (real tokens per second per GPU) first."""
    rows = []
    for mode, cp, comm in options(gpus, model.shape, int(lengths.max()), rank_tokens):
        split_comm = "ring" if comm in ("none", "a2a") else comm
        run = mode_run(lengths, mode, world=gpus, cp=cp, rank_tokens=rank_tokens, micro_batches=micro_batches,
                       split_comm=split_comm, model=model)  # fmt: skip
        times = model.run(run)
        rows.append({
            "mode": mode, "dp": gpus // cp, "cp": cp, "comm": comm, "steps": run.steps, **times.summary(),
            "tokens_per_s_per_gpu": float(run.entry_length.sum()) / float(times.step.sum()) / gpus,
        })  # fmt: skip
    return sorted(rows, key=lambda r: -r["tokens_per_s_per_gpu"])


def format_rows(rows: list[dict[str, object]]) -> str:
    head = "| dp | cp | placement | K/V | steps | step ms | " + " | ".join(PARTS) + " | tokens/s/GPU |"
    lines = [head, "|" + "---|" * (7 + len(PARTS))]
    for r in rows:
        placement = "whole (no CP)" if r["cp"] == 1 else r["mode"]
        parts = " | ".join(f"{r[f'{p}_ms']:.1f}" for p in PARTS)
        lines.append(
            f"| {r['dp']} | {r['cp']} | {placement} | {r['comm']} | {r['steps']} | {r['step_ms']:.1f} | {parts} | "
            f"{r['tokens_per_s_per_gpu']:,.0f} |"
        )
    return "\n".join(lines)
