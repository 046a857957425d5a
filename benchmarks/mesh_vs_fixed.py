"""Placement over the whole mesh (``cp = world``, ``auto``) against the best fixed dp x cp, by the step model.

    python benchmarks/mesh_vs_fixed.py                     # Alpaca, stdlib, long-tail mix, lognormal; 16 and 64 GPUs
    python benchmarks/mesh_vs_fixed.py --gpus 32 --model megatron-dcp-gpt --profile gb200_nvl72

For each data set (``cp_balance.py``'s, and Megatron's lognormal mix; sequences longer than
``--split`` tokens cut into pieces so that every CP size from 2 holds them) and GPU count, every
option ``thdpack plan --suggest`` weighs (``thdpack.perf.suggest``: each dp x cp with ``te``,
``adaptive``, ``a2a``, ``auto``, over the ring or an all-gather, and ``mesh``) is planned and
timed; the table gives the fastest fixed dp x cp, the fastest ``mesh`` option, and ``mesh``'s
real tokens per second per GPU relative to it. Building the mesh mode for training (many
placement groups, FSDP over the mesh) is worth it where that ratio reaches 1.05.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cp_auto import write_record
from cp_balance import datasets

from thdpack.perf.comm import Topology
from thdpack.perf.machine import PROFILE_NAMES, load_profile
from thdpack.perf.megatron import lognormal_lengths
from thdpack.perf.shape import NAMED_SHAPES, load_shape
from thdpack.perf.step import StepModel
from thdpack.perf.suggest import suggest
from thdpack.plan.overflow import apply_overflow

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("mode", "dp", "cp", "comm", "step_ms", "tokens_per_s_per_gpu")


def compare(lengths, model: StepModel, gpus: int, rank_tokens: int, micro_batches: int) -> dict[str, object]:
    rows = suggest(lengths, model, gpus=gpus, rank_tokens=rank_tokens, micro_batches=micro_batches)
    fixed = next(r for r in rows if r["mode"] != "mesh")
    mesh = next(r for r in rows if r["mode"] == "mesh")
    return {
        "best_fixed": {k: fixed[k] for k in KEYS},
        "mesh": {k: mesh[k] for k in KEYS},
        "mesh_vs_best_fixed": mesh["tokens_per_s_per_gpu"] / fixed["tokens_per_s_per_gpu"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--model", default="llama3-8b", help=f"a config.json or one of {', '.join(NAMED_SHAPES)}")
    parser.add_argument("--profile", default="h100_sxm", help=f"a profile JSON or one of {', '.join(PROFILE_NAMES)}")
    parser.add_argument("--rank-tokens", type=int, default=8192)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--split", type=int, default=16384, help="cut longer sequences into pieces of this many")
    parser.add_argument("--tiny", action="store_true", help="the first 3,000 sequences of each data set")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "mesh_vs_fixed.json")
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    model = StepModel(profile, load_shape(args.model), Topology.of(profile))
    sets = [(name, lengths) for name, lengths, _ in datasets(argparse.Namespace(lengths=None, pack_size=None,
                                                                                  tiny=args.tiny))]  # fmt: skip
    sets.append(("lognormal (Megatron's mix)", lognormal_lengths(3000 if args.tiny else 100_000, seed=0)))
    rows = []
    print("| data | GPUs | best fixed (mode, dp x cp, K/V) | its step ms | mesh (K/V) | its step ms | mesh / best |")
    print("|---|---|---|---|---|---|---|")
    for name, lengths in sets:
        pieces = apply_overflow(lengths, args.split, "split").length
        for gpus in args.gpus:
            row = {"data": name, "gpus": gpus, **compare(pieces, model, gpus, args.rank_tokens, args.micro_batches)}
            rows.append(row)
            f, m = row["best_fixed"], row["mesh"]
            print(
                f"| {name} | {gpus} | {f['mode']}, {f['dp']} x {f['cp']}, {f['comm']} | {f['step_ms']:.0f} | "
                f"{m['comm']} | {m['step_ms']:.0f} | {row['mesh_vs_best_fixed']:.3f} |",
                flush=True,
            )
    write_record(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
