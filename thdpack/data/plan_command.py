"""``thdpack plan --suggest``: the dp x cp, placement and K/V exchange to train a lengths file with.

    thdpack plan --suggest LENGTHS --model CONFIG_JSON|llama3-8b|114m|... --profile h100_sxm --gpus 64
        [--gpus-per-node 8] [--rank-tokens 8192] [--micro-batches 1] [--json out.json]

Every option the GPUs allow is planned as the trainer plans it and timed by the step model
(``thdpack.perf.suggest``, from the profile's public constants); the table gives each one's step
time and breakdown, fastest (real tokens per second per GPU) first.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from thdpack._settings import check_int
from thdpack.data.stats_command import load_lengths, without_empty
from thdpack.perf.comm import Topology
from thdpack.perf.machine import PROFILE_NAMES, load_profile
from thdpack.perf.shape import NAMED_SHAPES, load_shape
from thdpack.perf.step import StepModel, TrainingSpec
from thdpack.perf.suggest import format_rows, suggest


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


def run_plan(args: argparse.Namespace) -> int:
    for flag, value in (
        ("--gpus", args.gpus),
        ("--rank-tokens", args.rank_tokens),
        ("--micro-batches", args.micro_batches),
    ):
        check_int(flag, value, 1)
    if args.gpus_per_node is not None:
        check_int("--gpus-per-node", args.gpus_per_node, 1)
    path = args.suggest
    lengths = without_empty(load_lengths(path), path)
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
