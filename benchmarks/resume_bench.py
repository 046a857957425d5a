"""Elastic resume benchmark: recording an epoch's consumed pieces, and planning its rest again.

    python benchmarks/resume_bench.py                        # 1M sequences (the "web" lengths), ~1 min
    python benchmarks/resume_bench.py --sequences 100000
    python benchmarks/resume_bench.py --json benchmarks/results/resume.json

A run resumed with other plan settings (``thdpack.packing.step_stream``) reads the consumed pieces
from the checkpoint and plans the rest of the epoch (``Epochs.rest``); a checkpoint computes and
writes those pieces (``StreamState.state_dict``). For each change of settings the table gives,
half-way through epoch 0: the seconds to compute the consumed pieces and their record (bitmap,
pieces, sha256), its size, the seconds to plan the rest with the new settings (pieces, the planner
and the mapping back to the sequences), and the seconds the new settings take to plan a whole
epoch, for comparison. Times are the best of ``--repeats`` on a shared machine.
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from plan_bench import make_lengths  # noqa: E402

from thdpack.packing.dealing import Epochs  # noqa: E402
from thdpack.packing.pieces import arrays_digest  # noqa: E402
from thdpack.plan.config import PlanConfig  # noqa: E402

CHANGES = {
    "cp 2 -> cp 1": (dict(cp_placement="te"), 2, dict(cp_placement="te"), 1),
    "cp 1 -> cp 2": (dict(cp_placement="te"), 1, dict(cp_placement="te"), 2),
    "pack 4096 -> 8192": (dict(cp_placement="te"), 1, dict(cp_placement="te", pack_size=8192), 1),
    "cp 2 te -> cp 2 adaptive": (dict(cp_placement="te"), 2, dict(cp_placement="adaptive"), 2),
    "pack 2048 (split) -> 4096": (dict(cp_placement="te", pack_size=2048), 1, dict(cp_placement="te"), 1),
}
"""name: (settings before, cp before, settings after, cp after) over 4096-token packs."""


def best(seconds: list[float]) -> float:
    return min(seconds)


def measure(lengths: np.ndarray, change: str, repeats: int) -> dict:
    before, cp_before, after, cp_after = CHANGES[change]
    base = PlanConfig(pack_size=4096, seed=0, overflow="split")
    old = Epochs(lengths, replace(base, **before), cp_size=cp_before, shuffle=True)[0]
    new_epochs = Epochs(lengths, replace(base, **after), cp_size=cp_after, shuffle=True)
    half = len(old) // 2
    record_s, rest_s, whole_s = [], [], []
    for _ in range(repeats):
        tick = time.perf_counter()
        consumed = old.consumed(half)
        arrays = consumed.to_arrays(lengths)
        digest = arrays_digest(arrays)
        record_s.append(time.perf_counter() - tick)
        tick = time.perf_counter()
        rest = new_epochs.rest(0, consumed, replans=1)
        rest_s.append(time.perf_counter() - tick)
        tick = time.perf_counter()
        Epochs(lengths, replace(base, **after), cp_size=cp_after, shuffle=True)[0]
        whole_s.append(time.perf_counter() - tick)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    assert rest is not None and rest.items is not None
    return {
        "change": change,
        "sequences": len(lengths),
        "consumed_sequences": consumed.count_sequences(),
        "consumed_in_part": consumed.count_sequences() - consumed.count_whole(lengths),
        "rest_sequences": rest.items.count_sequences(),
        "rest_packs": len(rest),
        "record_s": best(record_s),
        "record_bytes": len(buffer.getvalue()),
        "digest": digest[:12],
        "replan_rest_s": best(rest_s),
        "plan_epoch_s": best(whole_s),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    lengths, _ = make_lengths("web", args.sequences)
    rows = [measure(lengths, change, args.repeats) for change in CHANGES]
    print(f"### Planning the rest of an epoch: {args.sequences:,} sequences ('web' lengths), half the epoch consumed")
    print(f"({platform.processor() or platform.machine()}, numpy {np.__version__}; best of {args.repeats})\n")
    print(
        "| change | consumed (in part) / rest sequences | record: s, bytes | re-plan the rest (s) "
        "| plan a whole epoch (s) |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['change']} | {r['consumed_sequences']:,} ({r['consumed_in_part']:,}) / {r['rest_sequences']:,} "
            f"| {r['record_s']:.3f}, "
            f"{r['record_bytes']:,} | {r['replan_rest_s']:.3f} | {r['plan_epoch_s']:.3f} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
