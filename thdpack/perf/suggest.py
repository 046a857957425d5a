"""``thdpack plan --suggest``: the dp x cp, placement and K/V exchange to train a lengths file with.

    thdpack plan --suggest LENGTHS --model CONFIG_JSON|llama3-8b|114m|... --profile h100_sxm --gpus 64
        [--gpus-per-node 8] [--rank-tokens 8192] [--micro-batches 1] [--json out.json]

Every option the GPUs allow is planned as the trainer plans it and timed by the step model
(``thdpack.perf.step``, from the profile's public constants): CP sizes that divide the GPU count
and hold the longest sequence whole in a pack of ``cp x rank_tokens`` tokens, each with TE's
layout or the adaptive placement over the ring or an all-gather of K/V, the all-to-all where the
heads divide, ``auto`` (per pack the fastest of those by the model), and ``auto`` over every GPU
(``mesh``). Options are ranked by real
tokens per second per GPU; the table gives each one's step time and breakdown.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from thdpack.data.stats_command import load_lengths
from thdpack.perf.comm import Topology
from thdpack.perf.machine import PROFILE_NAMES, load_profile
from thdpack.perf.modes import mode_run
from thdpack.perf.shape import NAMED_SHAPES, ModelShape, load_shape
from thdpack.perf.step import PARTS, StepModel, TrainingSpec


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suggest", type=Path, required=True, metavar="LENGTHS",
                        help="sequence lengths: a .npy, a text file (one per line) or a token store")  # fmt: skip
    parser.add_argument("--model", default="llama3-8b",
                        help=f"a config.json (Hugging Face or ModelShape fields), one of {', '.join(NAMED_SHAPES)}, "
                        "or a thdpack preset (tiny, small, 114m)")  # fmt: skip
    parser.add_argument("--profile", default="h100_sxm", help=f"a profile JSON or one of {', '.join(PROFILE_NAMES)}")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of the run (dp x cp)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: the profile's")
    parser.add_argument("--rank-tokens", type=int, default=8192, help="tokens per GPU per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=1, help="packs per data-parallel rank per step")
    parser.add_argument("--overlap-dp", action=argparse.BooleanOptionalAction, default=True,
                        help="the gradient all-reduce overlaps the last backward (thdpack's trainer: yes)")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="write every option's numbers here")


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


def run_plan(args: argparse.Namespace) -> int:
    path = args.suggest
    lengths = load_lengths(path)
    lengths = lengths[lengths > 0]  # records that tokenized to nothing have no work
    if not len(lengths):
        raise ValueError(f"{path} holds no sequence of at least one token")
    profile = load_profile(args.profile)
    shape = load_shape(args.model)
    model = StepModel(
        profile, shape, Topology.of(profile, args.gpus_per_node), TrainingSpec(overlap_dp=args.overlap_dp)
    )
    rows = suggest(lengths, model, gpus=args.gpus, rank_tokens=args.rank_tokens, micro_batches=args.micro_batches)
    if not rows:
        raise ValueError(
            f"no option fits: the longest sequence has {int(lengths.max()):,} tokens, over {args.gpus} GPUs x "
            f"--rank-tokens {args.rank_tokens}; raise --rank-tokens or --gpus"
        )
    print(
        f"{path.name}: {len(lengths):,} sequences; model {args.model}; profile {profile.name}; {args.gpus} GPUs "
        f"({model.topology.gpus_per_node} per node); packs of cp x {args.rank_tokens} tokens; modelled, ms per step"
    )
    print(format_rows(rows))
    best = rows[0]
    placement = "auto" if best["mode"] == "mesh" else best["mode"]
    print(
        f"suggested: dp={best['dp']} cp={best['cp']} cp_placement={placement} comm={best['comm']} "
        f"({best['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, step {best['step_ms']:.1f} ms)"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.json}")
    return 0
