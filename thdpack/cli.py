"""The ``thdpack`` command.

thdpack prepare INPUT --tokenizer TOK --pack-size L --cp-size C --out DIR
thdpack stats [INPUT] [--pack-size L ...] [--cp-size C] [--algorithm A ...] [--plot-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from thdpack import __version__
from thdpack.data.prepare import add_prepare_arguments, run_prepare
from thdpack.report import add_stats_arguments, run_stats

Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
COMMANDS: dict[str, Command] = {  # name -> (help, add its arguments, run it)
    "prepare": (
        "tokenize a dataset into a token store, plan its packs, print the packing stats",
        add_prepare_arguments,
        run_prepare,
    ),
    "stats": (
        "compare packing algorithms and pack sizes on a dataset's lengths",
        add_stats_arguments,
        run_stats,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="thdpack", description="Pack sequences into THD batches, exactly.")
    parser.add_argument("--version", action="version", version=f"thdpack {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, _) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run = COMMANDS[args.command][2]
    try:
        return run(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as err:
        print(f"thdpack {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
