"""``cp_placement="auto"`` against te / adaptive / a2a, by the step-time model, on real length mixes.

    python benchmarks/cp_auto.py                      # Alpaca L 8192, stdlib, long-tail mix, lognormal; cp 2-16
    python benchmarks/cp_auto.py --tiny               # the first 3,000 sequences of each (seconds; the test)
    python benchmarks/cp_auto.py --model megatron-dcp-gpt --profile gb200_nvl72 --cp-sizes 4 8
    python benchmarks/cp_auto.py --model 114m --cp-sizes 2 4 8 --json docs/performance/cp_auto_114m.json  # GPU preset

Each mode plans one epoch of the data set as the trainer does (packs of ``L`` tokens on ``cp``
ranks); every pack is timed alone by the step model (``thdpack.perf.auto.pack_seconds``: its
slowest rank's linear work, attention, exposed communication and host), and the epoch's time is
their sum (one data-parallel rank, one pack per step):

- ``te``: TE's packs and layout, the ring;
- ``adaptive``: the adaptive planner's packs and placement (tiles, the trainer's default);
- ``a2a``: packs of the raw lengths, all-to-all (where ``cp`` divides the heads);
- ``auto``: the adaptive packs placed by the ``time`` or the ``tiles`` cost model (whichever is
  faster), each pack attended the fastest of its placement, TE's layout and all-to-all
  (``thdpack.perf.auto``).

It also checks auto's promise on every pack of its plan: no pack is slower than the same pack by
its placement, by TE's layout (where the TE slots fit) or by all-to-all; ``violations`` counts
the packs that are (0 by construction).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cp_balance import TINY_SEQUENCES, datasets

from thdpack.layout.placement import CpPlacement
from thdpack.perf.auto import LAYOUTS, candidate_seconds, pack_seconds
from thdpack.perf.machine import PROFILE_NAMES
from thdpack.perf.megatron import lognormal_lengths
from thdpack.perf.shape import NAMED_SHAPES
from thdpack.perf.time_cost import TimeCostModel
from thdpack.plan import plan_packs
from thdpack.plan.adaptive import plan_entries
from thdpack.plan.auto import plan_auto
from thdpack.plan.overflow import apply_overflow

ROOT = Path(__file__).resolve().parents[1]
MODES = ("te", "adaptive", "a2a", "auto")
LOGNORMAL_SEQUENCES = 100_000


def measure(lengths: np.ndarray, pack_size: int, cp: int, timing: TimeCostModel) -> dict[str, object]:
    """Every mode's modelled epoch seconds, packs and (auto) choices for one data set and cp."""
    model = timing.model
    row: dict[str, object] = {}
    te = plan_packs(lengths, pack_size, cp_size=cp, overflow="split")
    te_placement = CpPlacement.all_split(te.offsets, te.entry_lengths_flat(), cp_size=cp, pack_size=pack_size)
    row["te"] = {"seconds": float(pack_seconds(te_placement, model).sum()), "packs": len(te)}
    adaptive = plan_packs(lengths, pack_size, cp_size=cp, cp_placement="adaptive", overflow="split")
    row["adaptive"] = {"seconds": float(pack_seconds(adaptive.placement, model).sum()), "packs": len(adaptive)}
    if model.shape.heads % cp == 0:
        raw = plan_packs(lengths, pack_size, overflow="split")
        entries = raw.entry_lengths_flat()
        size, start = np.full(len(entries), cp), np.zeros(len(entries), np.int64)
        a2a = CpPlacement(cp_size=cp, pack_size=pack_size, offsets=raw.offsets, lengths=entries, group_size=size,
                          group_start=start)  # fmt: skip
        row["a2a"] = {"seconds": float(pack_seconds(a2a, model, "a2a").sum()), "packs": len(raw)}
    tick = time.perf_counter()
    entries = apply_overflow(lengths, pack_size, "split").length
    *_, cost_model = plan_auto(entries, pack_size, cp, timing=timing, algorithm="bfd", window=1024, rng=None)
    plan_seconds = time.perf_counter() - tick
    # the chosen packing's placement before each pack's choice: every candidate of every pack
    placement = plan_entries(entries, pack_size, cp, algorithm="bfd", window=1024, rng=None,
                             cost_model=timing if cost_model == "time" else cost_model)[2]  # fmt: skip
    candidates = candidate_seconds(placement, model)
    chosen = candidates.min(axis=0)
    row["auto"] = {
        "seconds": float(chosen.sum()),
        "packs": len(placement),
        "packing": cost_model,
        "plan_seconds": plan_seconds,
        "chosen": {name: int((np.argmin(candidates, axis=0) == i).sum()) for i, name in enumerate(LAYOUTS)},
        "violations": int((chosen[None, :] > candidates).sum()),
    }
    for name in MODES:
        if name in row:
            row[name]["vs_te"] = row[name]["seconds"] / row["te"]["seconds"]
    return row


def table(rows: list[dict[str, object]]) -> str:
    lines = [
        "| data | L | cp | te s | adaptive / te | a2a / te | auto / te | auto vs best other | auto's packing | "
        "auto's packs: adaptive / te / a2a | violations |",
        "|---" * 11 + "|",
    ]
    for r in rows:
        others = [r[m]["seconds"] for m in ("te", "adaptive", "a2a") if m in r]
        a2a = f"{r['a2a']['vs_te']:.4f}" if "a2a" in r else "-"
        chosen = " / ".join(str(v) for v in r["auto"]["chosen"].values())
        lines.append(
            f"| {r['data']} | {r['pack_size']} | {r['cp_size']} | {r['te']['seconds']:.1f} | "
            f"{r['adaptive']['vs_te']:.4f} | {a2a} | {r['auto']['vs_te']:.4f} | "
            f"{r['auto']['seconds'] / min(others):.4f} | {r['auto']['packing']} | {chosen} | "
            f"{r['auto']['violations']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--model", default="llama3-8b", help=f"a config.json or one of {', '.join(NAMED_SHAPES)}")
    parser.add_argument("--profile", default="h100_sxm", help=f"a profile JSON or one of {', '.join(PROFILE_NAMES)}")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: the profile's")
    parser.add_argument("--tiny", action="store_true", help=f"the first {TINY_SEQUENCES:,} sequences of each")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "cp_auto.json")
    args = parser.parse_args(argv)
    timing = TimeCostModel.load(args.profile, args.model, args.gpus_per_node)
    sets = datasets(argparse.Namespace(lengths=None, pack_size=None, tiny=args.tiny))
    count = TINY_SEQUENCES if args.tiny else LOGNORMAL_SEQUENCES
    sets.append(("lognormal (Megatron's mix)", lognormal_lengths(count, seed=0), 16384))
    rows = []
    for data, lengths, pack_size in sets:
        for cp in args.cp_sizes:
            tick = time.perf_counter()
            row = {"data": data, "pack_size": pack_size, "cp_size": cp, "sequences": len(lengths)}
            row.update(measure(lengths, pack_size, cp, timing))
            rows.append(row)
            print(f"{data}, L {pack_size}, cp {cp}: {time.perf_counter() - tick:.1f} s", flush=True)
    print(f"model {args.model}, profile {args.profile}: modelled seconds of the epoch's packs, one at a time")
    print(table(rows))
    write_record(args, rows)
    return 0


def write_record(args: argparse.Namespace, rows: list[dict[str, object]]) -> None:
    """The rows, with the machine, model and profile they were modelled on, to ``args.json`` (if set)."""
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"machine": platform.platform(), "model": args.model, "profile": args.profile, "rows": rows}
        args.json.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
