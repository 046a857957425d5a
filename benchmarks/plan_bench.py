"""Planner benchmark: thdpack's algorithms, then the peers' planners in the same run, as ratios.

    python benchmarks/plan_bench.py                      # full run (~10 min on 2 cores)
    python benchmarks/plan_bench.py --quick              # 1M web + 100k uniform, fewer peers
    python benchmarks/plan_bench.py --peers none --big 0 # thdpack only
    python benchmarks/plan_bench.py --peers-python /tmp/peers-venv/bin/python   # real TRL / axolotl

The length distributions are the peers harness's (../shared/peers/bench_packing.py), same
seeds, so the numbers line up with ../shared/research/peers_packing_results.md. Quality is
measured against the Martello–Toth L2 lower bound; time is the best of several runs of the
planning call (noisy shared machine: compare ratios within one run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from thdpack.plan import ALGORITHMS, l2_lower_bound, plan_packs  # noqa: E402

HARNESS = REPO.parent / "shared" / "peers" / "bench_packing.py"
SEED = 1234
DISTS = {
    "web": ("lognormal(mean 800, sigma 1.0) clipped to [1, 4096]", 4096),
    "sft": ("lognormal(mean 250, sigma 1.0) clipped to [1, 2048]", 2048),
    "uniform": ("uniform integers [1, 8192]", 8192),
    "heavy": ("90% lognormal(mean 100, sigma 0.8) + 10% uniform [2048, 4096]", 4096),
}
DEFAULT_PEERS = (
    "sequential_next_fit,spfhp_krell2021,nemo_neat_wfd,llamafactory_as_used,axolotl_multipack,"
    "axolotl_sequential,megatron_ffd,trl_bfd_as_used"
)
QUICK_PEERS = "sequential_next_fit,spfhp_krell2021,nemo_neat_wfd,llamafactory_as_used"
# issue targets: (description, check)
TARGETS = {
    "time_1m_web": 0.05,
    "l2_lognormal": 1.0001,
    "l2_uniform_100k": 1.0002,
    "time_100m": 10.0,
    "rss_100m_gib": 4.0,
    "window_efficiency": 0.95,
}


def make_lengths(dist: str, n: int, seed: int = SEED) -> tuple[np.ndarray, int]:
    """(lengths int64 in [1, L], L): the harness's distributions, seeded per (dist, n)."""
    rng = np.random.default_rng([seed, n, sum(map(ord, dist))])

    def lognormal(mean: float, sigma: float, size: int) -> np.ndarray:
        return rng.lognormal(math.log(mean) - sigma * sigma / 2.0, sigma, size)

    cap = DISTS[dist][1]
    if dist == "web":
        x = lognormal(800.0, 1.0, n)
    elif dist == "sft":
        x = lognormal(250.0, 1.0, n)
    elif dist == "uniform":
        x = rng.integers(1, cap + 1, n)
    else:
        n_long = n // 10
        x = np.concatenate([lognormal(100.0, 0.8, n - n_long), rng.integers(cap // 2, cap + 1, n_long)])
        rng.shuffle(x)
    return np.clip(np.rint(x), 1, cap).astype(np.int64), cap


def best_time(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def own_rows(cells: list[tuple[str, int]], repeats: int) -> list[dict]:
    rows = []
    for dist, n in cells:
        lengths, cap = make_lengths(dist, n)
        for algorithm in ALGORITHMS:
            reps = repeats if algorithm in ("bfd", "sequential") else max(1, repeats // 2)
            seconds, plan = best_time(lambda a=algorithm, x=lengths, c=cap: plan_packs(x, c, algorithm=a), reps)
            s = plan.stats
            rows.append(
                {
                    "dist": dist,
                    "n": n,
                    "pack_size": cap,
                    "algorithm": algorithm,
                    "packs": s.num_packs,
                    "l2": s.lower_bound_packs,
                    "packs_over_l2": s.packs_over_lower_bound,
                    "efficiency": s.efficiency,
                    "seconds": seconds,
                }
            )
            print(
                f"  {dist:8s} n={n:>10,} {algorithm:10s} packs={s.num_packs:,} x L2 "
                f"{s.packs_over_lower_bound:.5f} eff {100 * s.efficiency:.3f}% {1e3 * seconds:.1f} ms",
                flush=True,
            )
    return rows


def big_run(n: int) -> dict:
    """Plan n web lengths in a fresh process; wall time of plan_packs and peak RSS of the process."""
    code = f"""
import json, math, resource, sys, time
import numpy as np
sys.path.insert(0, {str(REPO)!r})
from thdpack.plan import plan_packs
n = {n}
rng = np.random.default_rng([{SEED}, n, sum(map(ord, "web"))])
lengths = np.empty(n, dtype=np.int64)
for s in range(0, n, 10_000_000):
    m = min(10_000_000, n - s)
    lengths[s:s + m] = np.clip(np.rint(rng.lognormal(math.log(800) - 0.5, 1.0, m)), 1, 4096)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
plan = plan_packs(lengths, 4096)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"n": n, "seconds": seconds, "peak_rss_gib": peak / 2**20, "input_rss_gib": before / 2**20,
                  "packs": len(plan), "packs_over_l2": plan.stats.packs_over_lower_bound}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def peer_rows(cells: list[tuple[str, int]], peers: str, python: str, repeats: int) -> list[dict]:
    """Run the peers harness with thdpack's default planner as a candidate, one cell at a time."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dist, n in cells:
            json_path = Path(tmp) / f"{dist}_{n}.json"
            cmd = [
                python,
                str(HARNESS),
                "--dists",
                dist,
                "--sizes",
                str(n),
                "--peers",
                peers,
                "--candidate",
                "thdpack_bench:plan",
                "--candidate",
                "thdpack_bench:plan_window",
                "--candidate-path",
                str(HERE),
                "--reps",
                str(repeats),
                "--limit",
                "60",
                "--json",
                str(json_path),
                "--md",
                str(Path(tmp) / "peers.md"),
            ]
            print(f"  peers harness: {dist} n={n:,} ...", flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            results = json.loads(json_path.read_text())["results"][dist]["sizes"][str(n)]
            lengths, cap = make_lengths(dist, n)
            l2 = l2_lower_bound(np.bincount(lengths, minlength=cap + 1), cap)
            ours = results["candidate:thdpack_bench:plan"].get("best_s")
            for name, r in results.items():
                if "best_s" not in r:
                    rows.append({"dist": dist, "n": n, "packer": name, "skipped": r.get("skipped") or r.get("error")})
                    continue
                rows.append(
                    {
                        "dist": dist,
                        "n": n,
                        "packer": name.replace("candidate:thdpack_bench:", "thdpack "),
                        "packs": r["bins"],
                        "packs_over_l2": r["bins"] / l2,
                        "efficiency": r["efficiency"],
                        "seconds": r["best_s"],
                        "time_vs_thdpack": r["best_s"] / ours if ours else None,
                        "valid": r["valid"],
                        "comparable": r.get("comparable", True),
                    }
                )
    return rows


def print_tables(own: list[dict], peers: list[dict], big: dict | None) -> None:
    print("\n### thdpack planners\n")
    print("| dist | n | algorithm | packs | L2 bound | packs / L2 | efficiency | time |")
    print("|---|---|---|---|---|---|---|---|")
    for r in own:
        print(
            f"| {r['dist']} | {r['n']:,} | {r['algorithm']} | {r['packs']:,} | {r['l2']:,} | "
            f"{r['packs_over_l2']:.5f} | {100 * r['efficiency']:.3f}% | {_fmt(r['seconds'])} |"
        )
    if peers:
        print("\n### Side by side with the peers (same run; time ratio = peer time / thdpack bfd time)\n")
        print("| dist | n | packer | packs / L2 | efficiency | time | time ratio |")
        print("|---|---|---|---|---|---|---|")
        for r in sorted(peers, key=lambda r: (r["dist"], r["n"], r.get("seconds", float("inf")))):
            if "skipped" in r:
                print(f"| {r['dist']} | {r['n']:,} | {r['packer']} | - | - | - | {r['skipped']} |")
                continue
            note = "" if r["comparable"] else " (cuts sequences)"
            ratio = f"{r['time_vs_thdpack']:.1f}x" if r["time_vs_thdpack"] else "-"
            print(
                f"| {r['dist']} | {r['n']:,} | {r['packer']}{note} | {r['packs_over_l2']:.5f} | "
                f"{100 * r['efficiency']:.3f}% | {_fmt(r['seconds'])} | {ratio} |"
            )
    if big:
        print(f"\n### {big['n']:,} web lengths (fresh process)\n")
        print(
            f"plan_packs: {big['seconds']:.2f} s, peak RSS {big['peak_rss_gib']:.2f} GiB "
            f"(input alone {big['input_rss_gib']:.2f} GiB), packs / L2 {big['packs_over_l2']:.6f}"
        )


def check_targets(own: list[dict], big: dict | None) -> list[str]:
    lines = []
    for r in own:
        if r["algorithm"] == "bfd" and r["dist"] == "web" and r["n"] == 1_000_000:
            lines.append(
                _verdict(
                    "1M web lengths planned by the default in <= 0.05 s",
                    r["seconds"] <= TARGETS["time_1m_web"],
                    f"{1e3 * r['seconds']:.1f} ms",
                )
            )
        if r["algorithm"] == "bfd" and r["dist"] in ("web", "sft"):
            lines.append(
                _verdict(
                    f"{r['dist']} n={r['n']:,}: default <= 1.0001 x L2",
                    r["packs_over_l2"] <= TARGETS["l2_lognormal"],
                    f"{r['packs_over_l2']:.5f}",
                )
            )
        if r["algorithm"] == "bfd" and r["dist"] == "uniform" and r["n"] == 100_000:
            lines.append(
                _verdict(
                    "uniform 100k: default <= 1.0002 x L2",
                    r["packs_over_l2"] <= TARGETS["l2_uniform_100k"],
                    f"{r['packs_over_l2']:.5f}",
                )
            )
        if r["algorithm"] == "window":
            lines.append(
                _verdict(
                    f"window {r['dist']} n={r['n']:,}: efficiency >= 95%",
                    r["efficiency"] >= TARGETS["window_efficiency"],
                    f"{100 * r['efficiency']:.2f}%",
                )
            )
    if big:
        lines.append(
            _verdict(
                f"{big['n']:,} lengths in <= 10 s",
                big["seconds"] <= TARGETS["time_100m"],
                f"{big['seconds']:.2f} s",
            )
        )
        lines.append(
            _verdict(
                f"{big['n']:,} lengths within 4 GiB",
                big["peak_rss_gib"] <= TARGETS["rss_100m_gib"],
                f"{big['peak_rss_gib']:.2f} GiB peak RSS",
            )
        )
    return lines


def _verdict(what: str, ok: bool, value: str) -> str:
    return f"{'PASS' if ok else 'MISS'}  {what}: {value}"


def _fmt(seconds: float) -> str:
    return f"{1e3 * seconds:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1M web + 100k uniform, fewer peers, no 100M run")
    ap.add_argument("--repeats", type=int, default=7, help="best of this many runs per thdpack cell")
    ap.add_argument("--peers", default=None, help="'none', 'all' or a comma list of harness peer names")
    ap.add_argument(
        "--peers-python", default=sys.executable, help="interpreter for the harness (a venv with trl/axolotl)"
    )
    ap.add_argument("--big", type=int, default=None, help="also plan this many lengths in a fresh process (0: skip)")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "plan_bench.json")
    args = ap.parse_args(argv)

    if args.quick:
        cells = [("web", 1_000_000), ("uniform", 100_000)]
    else:
        cells = [
            ("web", 1_000_000),
            ("sft", 1_000_000),
            ("heavy", 1_000_000),
            ("uniform", 100_000),
            ("uniform", 1_000_000),
        ]
    peers = args.peers or (QUICK_PEERS if args.quick else DEFAULT_PEERS)
    big_n = args.big if args.big is not None else (0 if args.quick else 100_000_000)

    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}, numpy {np.__version__}"
    )
    print("thdpack planners:")
    own = own_rows(cells, args.repeats)
    peer_results: list[dict] = []
    if peers != "none":
        if HARNESS.exists():
            if peers == "all":
                peers = ""
            peer_results = peer_rows([c for c in cells if c != ("uniform", 1_000_000)], peers, args.peers_python, 3)
        else:
            print(f"peers harness not found at {HARNESS} (only the project's checkout has ../shared): skipped")
    big = big_run(big_n) if big_n else None
    print_tables(own, peer_results, big)
    verdicts = check_targets(own, big)
    print("\n### Targets\n")
    print("\n".join(verdicts))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "own": own,
                "peers": peer_results,
                "big": big,
                "targets": verdicts,
                "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            },
            indent=1,
        )
    )
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
