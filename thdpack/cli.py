"""The ``thdpack`` command.

    thdpack prepare INPUT --tokenizer TOK --pack-size L --cp-size C --out DIR [--on-bad-record skip]
    thdpack stats [INPUT] [--pack-size L ...] [--cp-size C] [--algorithm A ...] [--plot-dir DIR]
    thdpack verify --cp-size N [--dp-size M] [--dtype float64]
    thdpack plan --suggest LENGTHS --model CONFIG --profile h100_sxm --gpus N [--json out.json]
    thdpack calibrate --model CONFIG --out machine.json     (under torchrun: the links between ranks too)
    thdpack checkpoint info DIR                             (what a checkpoint's data stream consumed)

A subcommand's module is imported only when that subcommand runs (``verify`` needs torch,
``stats`` does not).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from thdpack._version import __version__

# name -> (help, module, its argument adder, its runner)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "prepare": (
        "tokenize a dataset into a token store, plan its packs, print the packing stats",
        "thdpack.data.prepare_command",
        "add_prepare_arguments",
        "run_prepare",
    ),
    "stats": (
        "compare packing algorithms and pack sizes on a dataset's lengths",
        "thdpack.data.stats_command",
        "add_stats_arguments",
        "run_stats",
    ),
    "plan": (
        "suggest dp x cp, placement and K/V exchange for a lengths file, by modelled step time",
        "thdpack.data.plan_command",
        "add_plan_arguments",
        "run_plan",
    ),
    "calibrate": (
        "time this machine's kernels, host and links for a model and write its step-model profile",
        "thdpack.calibrate.command",
        "add_calibrate_arguments",
        "run_calibrate",
    ),
    "checkpoint": (
        "print what a training checkpoint's data stream consumed and what remains, with its digest",
        "thdpack.train.checkpoint_command",
        "add_checkpoint_arguments",
        "run_checkpoint",
    ),
    "verify": (
        "prove on this machine that packed, CP-sharded training equals unpacked training",
        "thdpack.verify.command",
        "add_verify_arguments",
        "run_verify",
    ),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s arguments are loaded (all commands are listed)."""
    parser = argparse.ArgumentParser(prog="thdpack", description="Pack sequences into THD batches, exactly.")
    parser.add_argument("--version", action="version", version=f"thdpack {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, module, add_arguments, _) in COMMANDS.items():
        subparser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            getattr(importlib.import_module(module), add_arguments)(subparser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    _, module, _, runner = COMMANDS[args.command]
    try:
        return getattr(importlib.import_module(module), runner)(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as err:
        print(f"thdpack {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
