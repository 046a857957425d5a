"""``thdpack stats``: compare planners and pack sizes on a dataset's lengths; table, JSON, plots.

    thdpack stats                                   # the embedded example (CPython stdlib, GPT-2 tokens)
    thdpack stats lengths.npy --pack-size 8192 --cp-size 2 --plot-dir out/
    thdpack stats runs/web --pack-size 8192         # a token store: verified in full first (non-zero exit if damaged)

Every plan setting is an option generated from ``PlanConfig``'s fields (its defaults, but the
trainer's ``--cp-placement adaptive``); ``--pack-size`` and ``--algorithm`` take several values
to compare. The output says which CP placement it assumed, and for the embedded example that it
plans as the trainer does (``--overflow split`` unless given).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from thdpack._config_forms import add_options, from_flat
from thdpack._optional import has_module
from thdpack.data.store_verify import verify_store
from thdpack.files.safe_load import load_array
from thdpack.perf.time_cost import timing_of
from thdpack.plan.api import plan_with
from thdpack.plan.config import ALGORITHMS, TRAINING_CP_PLACEMENT, PlanConfig
from thdpack.plan.packing_stats import PackingStats

EXAMPLE = "python311_stdlib.gpt2.lengths.npy"
EXAMPLE_NOTE = "embedded example: the 1,790 .py files of CPython 3.11's standard library, in GPT-2 tokens"
EXAMPLE_OVERFLOW = "split"
"""The embedded example's overflow policy when ``--overflow`` is not given: the trainer's (its
packing presets split), so that ``thdpack stats`` alone plans the data the trainer trains on."""


def example_lengths_path() -> Path:
    """The embedded example's lengths file (shipped inside the package)."""
    return Path(str(resources.files("thdpack") / "assets" / "examples" / EXAMPLE))


def load_lengths(path: str | Path) -> np.ndarray:
    """Sequence lengths from ``.npy``, a text file (one integer per line), or a thdpack token store.

    ``(S,)`` int64 with S >= 1, every length >= 0; an empty or 2-D file or a negative length is a
    ``ValueError`` naming it. A store's
    lengths come from its offsets (checked in order, not read in full: ``verify_store`` does that).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_dir():
        from thdpack.data.store import TokenStore

        if not (path / "manifest.json").exists():
            raise ValueError(f"{path} is a folder but not a thdpack token store (no manifest.json)")
        lengths = TokenStore(path).lengths
    elif path.suffix == ".npy":
        lengths = load_array(path)
    elif path.suffix in (".txt", ".csv", ""):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # numpy warns on an empty file: reported below instead
                lengths = np.loadtxt(path, dtype=np.int64, ndmin=1)
        except ValueError as err:
            raise ValueError(f"{path}: expected one integer length per line ({err})") from err
    else:
        raise ValueError(f"{path}: unsupported lengths file {path.suffix!r}; use .npy, .txt or a token store folder")
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"{path} holds {lengths.dtype} of shape {lengths.shape}; expected 1-D integer lengths")
    if len(lengths) == 0:
        raise ValueError(f"{path} holds no lengths (0 sequences); give a file with one length per sequence")
    negative = np.flatnonzero(lengths < 0)
    if len(negative):
        i = int(negative[0])
        raise ValueError(
            f"{path}: sequence {i} has length {int(lengths[i])} ({len(negative):,} negative in all); a length "
            "counts tokens, so it is 0 or more"
        )
    return lengths.astype(np.int64, copy=False)


def without_empty(lengths: np.ndarray, source: str | Path) -> np.ndarray:
    """``lengths`` without its zeros, printing how many were left out (they hold no token to train
    on); ``ValueError`` naming ``source`` when nothing is left."""
    empty = int((lengths == 0).sum())
    if not empty:
        return lengths
    print(f"skipped {empty:,} empty sequences (length 0): they hold no token to train on")
    if empty == len(lengths):
        raise ValueError(f"{source}: all {empty:,} sequences are empty; there is nothing to pack")
    return lengths[lengths != 0]


@dataclass(frozen=True)
class Row:
    """One planner run."""

    algorithm: str
    pack_size: int
    seconds: float
    stats: PackingStats


def compare(lengths: np.ndarray, configs: list[PlanConfig], *, cp_size: int) -> list[Row]:
    """Plan with every config; time each plan (best of 3 for short runs)."""
    rows = []
    for config in configs:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            plan = plan_with(lengths, config, cp_size=cp_size, timing=timing_of(config))
            best = min(best, time.perf_counter() - start)
            if best > 0.5:
                break
        rows.append(Row(config.algorithm, config.pack_size, best, plan.stats))
    return rows


def render(rows: list[Row]) -> str:
    """Markdown table of the runs."""
    head = (
        "| pack size | algorithm | packs | L2 bound | packs/L2 | efficiency | cp pad | tail pad | "
        "max seqs/pack | time (ms) |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        s = r.stats
        lines.append(
            f"| {r.pack_size:,} | {r.algorithm} | {s.num_packs:,} | {s.lower_bound_packs:,} | "
            f"{s.packs_over_lower_bound:.5f} | {100 * s.efficiency:.3f}% | {s.cp_padding_tokens:,} | "
            f"{s.tail_padding_tokens:,} | {s.max_sequences_per_pack} | {1e3 * r.seconds:.1f} |"
        )
    return "\n".join(lines)


def plot(lengths: np.ndarray, rows: list[Row], out_dir: Path) -> list[Path]:
    """PNG plots: length histogram, pack fullness percentiles, and (for several pack sizes)
    waste vs pack size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(lengths, bins=np.logspace(0, np.log10(max(2, lengths.max())), 60))
    ax.set(xscale="log", xlabel="sequence length (tokens)", ylabel="sequences", title="Length histogram")
    written.append(out_dir / "lengths.png")
    fig.savefig(written[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        pct = r.stats.fullness_percentiles
        ax.plot(list(pct), [100 * v for v in pct.values()], marker="o", label=f"{r.algorithm} @ {r.pack_size}")
    ax.set(xlabel="percentile of packs", ylabel="pack fullness (%)", title="Pack fullness")
    ax.legend(fontsize=7)
    written.append(out_dir / "fullness.png")
    fig.savefig(written[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    if len({r.pack_size for r in rows}) < 2:
        return written
    fig, ax = plt.subplots(figsize=(7, 4))
    for algorithm in dict.fromkeys(r.algorithm for r in rows):
        mine = [r for r in rows if r.algorithm == algorithm]
        ax.plot(
            [r.pack_size for r in mine],
            [100 * (1 - r.stats.efficiency) for r in mine],
            marker="o",
            label=algorithm,
        )
    ax.set(xscale="log", xlabel="pack size (tokens)", ylabel="wasted tokens (%)", title="Waste vs pack size")
    ax.legend()
    written.append(out_dir / "waste_vs_pack_size.png")
    fig.savefig(written[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return written


def add_stats_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``thdpack stats`` arguments: the input, the CP size, and every plan setting (``--pack-size``
    and ``--algorithm`` take several values, each pair one row)."""
    parser.add_argument(
        "input",
        nargs="?",
        help="lengths .npy / .txt, or a token store folder (verified in full first; default: embedded example)",
    )
    parser.add_argument("--cp-size", type=int, default=1, help="context-parallel size (slots rounded to 2*cp)")
    add_options(
        parser,
        PlanConfig,
        defaults={
            "pack_size": [4096],
            "algorithm": ["all"],
            "cp_placement": TRAINING_CP_PLACEMENT,
            "overflow": None,
        },
        many=("pack_size", "algorithm"),
        more_choices={"algorithm": ("all",)},
        notes={
            "pack_size": "One or more: each is planned.",
            "algorithm": "One or more, or 'all': each is planned.",
            "overflow": f"None: PlanConfig's, 'error'; without INPUT, {EXAMPLE_OVERFLOW!r} (the trainer's).",
        },
    )
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--plot-dir", type=Path, help="write PNG plots here (needs matplotlib)")


def plan_configs(args: argparse.Namespace) -> list[PlanConfig]:
    """One ``PlanConfig`` per (pack size, algorithm) of the command line, the other settings its
    options; an ``--overflow`` not given is PlanConfig's for an INPUT, the trainer's for the example."""
    algorithms = list(ALGORITHMS) if "all" in args.algorithm else args.algorithm
    settings = vars(args).copy()
    if settings["overflow"] is None:
        if args.input:
            del settings["overflow"]
        else:
            settings["overflow"] = EXAMPLE_OVERFLOW
    return [
        from_flat(PlanConfig, {**settings, "pack_size": pack_size, "algorithm": algorithm})
        for pack_size in args.pack_size
        for algorithm in algorithms
    ]


def placement_note(cp_size: int, cp_placement: str) -> str:
    """Which CP layout the plans assume, and how to get the other."""
    if cp_size == 1:
        return "cp placement: none (cp_size 1: every sequence on one rank)"
    if cp_placement == "auto":
        return (
            f"cp placement: auto (each pack the fastest by the step model of --profile and --model-shape: adaptive, "
            f"TE's layout over all {cp_size} CP ranks, or all-to-all)"
        )
    if cp_placement == "adaptive":
        return (
            f"cp placement: adaptive (the trainer's default: short sequences whole on one of the {cp_size} CP ranks, "
            "long ones split over a group); --cp-placement te plans Transformer Engine's layout"
        )
    return (
        f"cp placement: te (Transformer Engine's layout: every sequence split over all {cp_size} CP ranks); "
        "the trainer defaults to --cp-placement adaptive"
    )


def run_stats(args: argparse.Namespace) -> int:
    configs = plan_configs(args)  # the settings are checked before a store is read
    source = Path(args.input) if args.input else example_lengths_path()
    if source.is_dir():  # a token store: read every byte against its checksums before trusting it
        print(verify_store(source))
    lengths = load_lengths(source)
    print(f"input: {source if args.input else EXAMPLE_NOTE}")
    if not args.input and args.overflow is None:
        print(
            f"overflow: {EXAMPLE_OVERFLOW} (the trainer's, for the embedded example: its files longer than a pack "
            "are split; --overflow error stops at the first)"
        )
    lengths = without_empty(lengths, source)
    print(
        f"{len(lengths):,} sequences, {int(lengths.sum()):,} tokens, lengths min {lengths.min():,} / "
        f"median {int(np.median(lengths)):,} / max {lengths.max():,}\n"
    )
    print(placement_note(args.cp_size, configs[0].cp_placement))
    rows = compare(lengths, configs, cp_size=args.cp_size)
    print(render(rows))
    best = min(rows, key=lambda r: (r.stats.num_packs / r.stats.lower_bound_packs, r.seconds))
    print(f"\nbest: {best.algorithm} @ pack_size {best.pack_size:,}\n{best.stats}")
    if args.json:
        payload = [
            {"algorithm": r.algorithm, "pack_size": r.pack_size, "seconds": r.seconds, **r.stats.to_dict()}
            for r in rows
        ]
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
    if args.plot_dir:
        if not has_module("matplotlib"):
            print("no plots: matplotlib is not installed (pip install 'thdpack[train]')")
        else:
            for path in plot(lengths, rows, args.plot_dir):
                print(f"wrote {path}")
    return 0
