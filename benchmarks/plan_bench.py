"""Planner benchmark: the improvement phase before/after, thdpack's algorithms, the peers, the targets.

    python benchmarks/plan_bench.py --shared /work/shared          # everything (~25 min on 2 cores)
    python benchmarks/plan_bench.py --tiny                         # seconds: what the tests run
    python benchmarks/plan_bench.py --sections improve,targets     # some sections only
    python benchmarks/plan_bench.py --peers none                   # no peers
    python benchmarks/plan_bench.py --peers-python /tmp/peers-venv/bin/python   # real TRL / axolotl

Sections (``--sections``, comma list):

- ``improve``: the improvement phase (issue 18) before and after, ``plan_packs(improve=False)``
  and ``plan_packs()`` on the same lengths, timed in the same run: uniform [1, L] and lognormal
  web lengths (100 draws of 100k), Alpaca raw and templated and the Python stdlib (100
  bootstrap resamples each, the data itself first), at L 2048 and 8192 and cp_size 1, 2, 4;
  packs over the Martello-Toth bound L2 and over thdpack's best bound, and the median time.
- ``peers``: the peers' planners (``../shared/peers``, run by its harness's own ``measure``: a
  forked child, validated output) on the first instance of each (distribution, L) at cp_size 1,
  beside thdpack before and after.
- ``targets``: issue 18's targets (templated Alpaca at L 2048 / 4096, uniform and lognormal at
  100k and 1M, the time of the phase on 1M web lengths, 52k Alpaca and 100k uniform plans, a
  1B-length histogram in a fresh process) and the earlier ones (1M web in 50 ms, 100M lengths).
- ``algorithms``: thdpack's four algorithms on the harness's distributions.

"Templated Alpaca" is Alpaca as ``thdpack prepare`` stores it: ``write_token_store`` on
``alpaca_data.json`` with the gpt2 tokenizer (its prompt template makes every sample >= 36
tokens), lengths cached in ``benchmarks/results/cache``. The stdlib files longer than a pack are
split (``overflow="split"``) and its 28 empty files left out. Times are on a noisy shared machine:
compare ratios within one run.
"""

from __future__ import annotations

import argparse
import importlib.util
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

SEED = 1234
SECTIONS = ("improve", "peers", "targets", "algorithms")
DISTS = {
    "web": ("lognormal(mean 800, sigma 1.0) clipped to [1, 4096]", 4096),
    "sft": ("lognormal(mean 250, sigma 1.0) clipped to [1, 2048]", 2048),
    "uniform": ("uniform integers [1, 8192]", 8192),
    "heavy": ("90% lognormal(mean 100, sigma 0.8) + 10% uniform [2048, 4096]", 4096),
}
IMPROVE_DISTS = ("uniform", "web", "alpaca raw", "alpaca templated", "stdlib")
PEERS = (
    "sequential_next_fit,spfhp_krell2021,nemo_neat_wfd,llamafactory_as_used,llamafactory_global,"
    "axolotl_multipack,megatron_ffd,trl_bfd_as_used"
)
TINY_PEERS = "sequential_next_fit,spfhp_krell2021"


def make_lengths(dist: str, n: int, seed: int = SEED) -> tuple[np.ndarray, int]:
    """(lengths int64 in [1, L], L): the peers harness's distributions, seeded per (dist, n)."""
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


# -- the data sets of the before/after table -------------------------------------------------
class Datasets:
    """The lengths of each (distribution, instance) at pack size L: random draws or bootstrap
    resamples of the real data (instance 0: the data itself)."""

    def __init__(self, shared: Path, n: int, tiny: bool) -> None:
        self.n = n
        data = shared / "data"
        self.real: dict[str, np.ndarray] = {}
        raw = data / "alpaca_data.gpt2.lengths.npy"
        if raw.exists():
            self.real["alpaca raw"] = np.load(raw).astype(np.int64)
        if (data / "alpaca_data.json").exists():
            self.real["alpaca templated"] = templated_alpaca(data / "alpaca_data.json", limit=2000 if tiny else None)
        stdlib = data / "python311_stdlib.gpt2.lengths.npy"
        if stdlib.exists():
            lengths = np.load(stdlib).astype(np.int64)
            self.real["stdlib"] = lengths[lengths > 0]  # empty files are no sequences

    def available(self) -> list[str]:
        return [d for d in IMPROVE_DISTS if d in ("uniform", "web") or d in self.real]

    def lengths(self, dist: str, pack_size: int, instance: int) -> np.ndarray:
        if dist in ("uniform", "web"):
            return random_lengths(dist, self.n, pack_size, instance)
        real = self.real[dist]
        rng = np.random.default_rng([SEED, instance, pack_size, sum(map(ord, dist))])
        return real if instance == 0 else rng.choice(real, len(real))


def random_lengths(dist: str, n: int, pack_size: int, instance: int) -> np.ndarray:
    """Draw ``instance`` of ``n`` lengths in [1, pack_size]: "uniform", or "web" (lognormal of
    mean 800 and sigma 1, the harness's web distribution, clipped to the pack)."""
    rng = np.random.default_rng([SEED, instance, n, pack_size, sum(map(ord, dist))])
    if dist == "uniform":
        return rng.integers(1, pack_size + 1, n)
    x = rng.lognormal(math.log(800.0) - 0.5, 1.0, n)
    return np.clip(np.rint(x), 1, pack_size).astype(np.int64)


def templated_alpaca(records: Path, *, limit: int | None = None) -> np.ndarray:
    """Sample lengths of Alpaca as ``thdpack prepare`` stores it (gpt2, labels format), cached."""
    cache = HERE / "results" / "cache" / f"alpaca_templated.gpt2{'' if limit is None else f'.{limit}'}.lengths.npy"
    if cache.exists():
        return np.load(cache)
    from thdpack.data.write_store import write_token_store

    with tempfile.TemporaryDirectory() as tmp:
        store = write_token_store([str(records)], Path(tmp) / "store", limit=limit, progress=False, verbose=False)
        lengths = np.asarray(store.lengths, dtype=np.int64)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, lengths)
    return lengths


def overflow_of(dist: str) -> str:
    return "split" if dist == "stdlib" else "error"


# -- section: improve --------------------------------------------------------------------------
def improve_rows(data: Datasets, pack_sizes: list[int], cp_sizes: list[int], instances: int) -> list[dict]:
    """One row per (dist, L, cp): the phase's before/after over ``instances`` instances."""
    rows = []
    for dist in data.available():
        for pack_size in pack_sizes:
            for cp_size in cp_sizes:
                cells = []
                for i in range(instances):
                    lengths = data.lengths(dist, pack_size, i)
                    kwargs = {"cp_size": cp_size, "overflow": overflow_of(dist)}
                    start = time.perf_counter()
                    fit = plan_packs(lengths, pack_size, improve=False, **kwargs)
                    middle = time.perf_counter()
                    plan = plan_packs(lengths, pack_size, **kwargs)
                    end = time.perf_counter()
                    s = plan.stats
                    cells.append(
                        (
                            len(fit),
                            len(plan),
                            s.lower_bound_packs,
                            s.best_lower_bound_packs,
                            middle - start,
                            end - middle,
                        )
                    )
                c = np.array(cells, dtype=np.float64)
                fit, packs, l2, best = c[:, 0], c[:, 1], c[:, 2], c[:, 3]
                allowed = np.maximum(l2 + 1, np.floor(1.0001 * l2))  # issue 18's target for random lengths
                row = {
                    "dist": dist,
                    "n": len(data.lengths(dist, pack_size, 0)),
                    "pack_size": pack_size,
                    "cp_size": cp_size,
                    "instances": instances,
                    "fit_over_l2_mean": float((fit - l2).mean()),
                    "over_l2_mean": float((packs - l2).mean()),
                    "fit_over_l2_max": int((fit - l2).max()),
                    "over_l2_max": int((packs - l2).max()),
                    "fit_ratio_max": float((fit / l2).max()),
                    "ratio_max": float((packs / l2).max()),
                    "at_l2_plus_1": int((packs <= l2 + 1).sum()),
                    "within_target": int((packs <= allowed).sum()),
                    "target_out_of_reach": int((best > allowed).sum()),
                    "fit_at_l2_plus_1": int((fit <= l2 + 1).sum()),
                    "over_best_max": int((packs - best).max()),
                    "optimal": int((packs <= best).sum()),
                    "fit_optimal": int((fit <= best).sum()),
                    "more_than_fit": int((packs > fit).sum()),
                    "fit_seconds": float(np.median(c[:, 4])),
                    "seconds": float(np.median(c[:, 5])),
                    "seconds_max": float(c[:, 5].max()),
                }
                rows.append(row)
                print(
                    f"  {dist:16s} L={pack_size} cp={cp_size}: packs - L2 {row['fit_over_l2_mean']:.2f} -> "
                    f"{row['over_l2_mean']:.2f} (max {row['fit_over_l2_max']} -> {row['over_l2_max']}), optimal "
                    f"{row['fit_optimal']} -> {row['optimal']} of {instances}, {_fmt(row['fit_seconds'])} -> "
                    f"{_fmt(row['seconds'])}",
                    flush=True,
                )
    return rows


# -- section: peers ----------------------------------------------------------------------------
def load_harness(shared: Path):
    """The peers harness module (``shared/peers/bench_packing.py``), or None when absent."""
    path = shared / "peers" / "bench_packing.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("bench_packing", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_packing"] = module
    spec.loader.exec_module(module)
    return module


def thdpack_peers(harness) -> list:
    """thdpack before and after the phase, as harness peers (measured the same way as theirs)."""

    def planner(improve: bool):
        return lambda lengths, pack_size: plan_packs(lengths, pack_size, improve=improve)

    return [
        harness.Peer("thdpack bfd", "thdpack plan_packs(improve=False)", "candidate", "thdpack", planner(False)),
        harness.Peer("thdpack bfd+improve", "thdpack plan_packs()", "candidate", "thdpack", planner(True)),
    ]


def peer_rows(harness, cells: list[tuple[str, np.ndarray, int]], names: str, repeats: int) -> list[dict]:
    """Every chosen peer and thdpack on each (name, lengths, L): packs over L2, time."""
    wanted = set(names.split(","))
    peers = [p for p in harness.build_peers() if p.name in wanted] + thdpack_peers(harness)
    harness.warm_up(peers)
    rows = []
    for name, lengths, pack_size in cells:
        l2 = l2_lower_bound(np.bincount(lengths, minlength=pack_size + 1), pack_size)
        print(f"  peers on {name} (n={len(lengths):,}, L={pack_size}) ...", flush=True)
        results = {}
        for peer in peers:
            r = harness.measure(peer, lengths, pack_size, repeats, 60.0, 60.0, 16 * 1024)
            results[peer.name] = r
        ours = results["thdpack bfd+improve"].get("best_s")
        for peer in peers:
            r = results[peer.name]
            row = {"data": name, "n": len(lengths), "pack_size": pack_size, "packer": peer.name, "kind": peer.kind}
            if "best_s" not in r:
                row["skipped"] = r.get("skipped") or r.get("error", "?").splitlines()[0]
            else:
                row.update(
                    packs=r["bins"],
                    l2=l2,
                    over_l2=r["bins"] - l2,
                    seconds=r["best_s"],
                    time_vs_thdpack=r["best_s"] / ours if ours else None,
                    valid=r["valid"],
                    comparable=r.get("comparable", True),
                )
            rows.append(row)
    return rows


# -- section: targets --------------------------------------------------------------------------
def best_time(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def target_rows(data: Datasets, large: int, large_instances: int, repeats: int) -> list[dict]:
    """What the targets need beyond the before/after table: 1M draws, the timed cells."""
    rows = []
    for dist, pack_size in (("uniform", 8192), ("web", 4096)):
        for i in range(large_instances):
            lengths = random_lengths(dist, large, pack_size, i)
            fit = plan_packs(lengths, pack_size, improve=False)
            plan = plan_packs(lengths, pack_size)
            s = plan.stats
            rows.append(
                {
                    "what": "large",
                    "dist": dist,
                    "n": large,
                    "pack_size": pack_size,
                    "instance": i,
                    "fit_packs": len(fit),
                    "packs": len(plan),
                    "l2": s.lower_bound_packs,
                    "best": s.best_lower_bound_packs,
                }
            )
            print(
                f"  {dist} n={large:,} #{i}: {len(fit)} -> {len(plan)} "
                f"(L2 {s.lower_bound_packs}, best {s.best_lower_bound_packs})",
                flush=True,
            )
    timed = [("web", f"web {large:,} (the harness's draw)", *make_lengths("web", large), 1)]
    timed.append(("uniform", f"uniform {data.n:,}", data.lengths("uniform", 8192, 0), 8192, 1))
    if "alpaca templated" in data.real:
        for pack_size in (2048, 4096):
            for cp_size in (1, 2, 4):
                lengths = data.real["alpaca templated"]
                timed.append(("alpaca", f"alpaca templated cp {cp_size}", lengths, pack_size, cp_size))
    for kind, name, lengths, pack_size, cp_size in timed:
        fit_s, fit = best_time(
            lambda x=lengths, p=pack_size, c=cp_size: plan_packs(x, p, cp_size=c, improve=False), repeats
        )
        s_, plan = best_time(lambda x=lengths, p=pack_size, c=cp_size: plan_packs(x, p, cp_size=c), repeats)
        st = plan.stats
        rows.append(
            {
                "what": "timed",
                "kind": kind,
                "data": name,
                "n": len(lengths),
                "pack_size": pack_size,
                "cp_size": cp_size,
                "fit_packs": len(fit),
                "packs": len(plan),
                "l2": st.lower_bound_packs,
                "best": st.best_lower_bound_packs,
                "fit_seconds": fit_s,
                "seconds": s_,
            }
        )
        print(
            f"  {name} L={pack_size}: {len(fit)} -> {len(plan)} (L2 {st.lower_bound_packs}), "
            f"{_fmt(fit_s)} -> {_fmt(s_)}",
            flush=True,
        )
    return rows


PEAK_RSS = """
def peak_rss_gib():
    # VmHWM: this process's own high-water mark (ru_maxrss keeps the forking parent's across exec)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20
"""


def histogram_run(total: int) -> dict:
    """Plan a histogram of ``total`` web lengths (L 4096) in a fresh process: seconds, peak RSS."""
    code = (
        PEAK_RSS
        + f"""
import json, math, sys, time
import numpy as np
sys.path.insert(0, {str(REPO)!r})
from thdpack.plan.size_classes import plan_size_classes
from thdpack.plan.bounds import l2_lower_bound_of_sizes
L = 4096
edges = np.arange(0.5, L + 1.5)
edges[0], edges[-1] = 0.0, math.inf
mu, sigma = math.log(800) - 0.5, 1.0
def lognormal_cdf(e):
    if e <= 0 or e == math.inf:
        return 0.0 if e <= 0 else 1.0
    return 0.5 * (1 + math.erf((math.log(e) - mu) / (sigma * math.sqrt(2))))
cdf = np.array([lognormal_cdf(e) for e in edges])
counts = np.random.default_rng({SEED}).multinomial({total}, np.diff(cdf))
sizes = np.flatnonzero(counts) + 1
counts = counts[sizes - 1]
before = peak_rss_gib()
start = time.perf_counter()
fit = plan_size_classes(sizes, counts, L, improve=False)
fit_seconds = time.perf_counter() - start
start = time.perf_counter()
hp = plan_size_classes(sizes, counts, L)
seconds = time.perf_counter() - start
print(json.dumps({{"lengths": int(counts.sum()), "seconds": seconds, "fit_seconds": fit_seconds,
                  "peak_rss_gib": peak_rss_gib(), "rss_before_gib": before, "fit_packs": fit.num_packs,
                  "packs": hp.num_packs, "l2": l2_lower_bound_of_sizes(sizes, counts, L)}}))
"""
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def big_run(n: int) -> dict:
    """Plan n web lengths in a fresh process; wall time of plan_packs and peak RSS of the process."""
    code = (
        PEAK_RSS
        + f"""
import json, math, sys, time
import numpy as np
sys.path.insert(0, {str(REPO)!r})
from thdpack.plan import plan_packs
n = {n}
rng = np.random.default_rng([{SEED}, n, sum(map(ord, "web"))])
lengths = np.empty(n, dtype=np.int64)
for s in range(0, n, 10_000_000):
    m = min(10_000_000, n - s)
    lengths[s:s + m] = np.clip(np.rint(rng.lognormal(math.log(800) - 0.5, 1.0, m)), 1, 4096)
before = peak_rss_gib()
start = time.perf_counter()
plan = plan_packs(lengths, 4096)
seconds = time.perf_counter() - start
print(json.dumps({{"n": n, "seconds": seconds, "peak_rss_gib": peak_rss_gib(), "input_rss_gib": before,
                  "packs": len(plan), "packs_over_l2": plan.stats.packs_over_lower_bound}}))
"""
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_targets(improve: list[dict], targets: list[dict], histogram: dict | None, big: dict | None) -> list[str]:
    lines = []
    if improve:
        more = sum(r["more_than_fit"] for r in improve)
        total = sum(r["instances"] for r in improve)
        lines.append(_verdict("never more packs than bfd", more == 0, f"{more} of {total} instances over all cells"))
    for r in improve:
        if r["dist"] in ("uniform", "web"):
            lines.append(
                _verdict(
                    f"{r['dist']} n={r['n']:,} L={r['pack_size']} cp={r['cp_size']}: <= max(L2 + 1, 1.0001 x L2)",
                    r["within_target"] == r["instances"],
                    f"{r['within_target']}/{r['instances']} (out of reach by the best bound: "
                    f"{r['target_out_of_reach']}); max {r['ratio_max']:.5f} x L2 (bfd {r['fit_ratio_max']:.5f}); "
                    f"{r['optimal']} proven optimal, at most {r['over_best_max']} over the best bound",
                )
            )
    for r in targets:
        if r["what"] == "large":
            allowed = max(r["l2"] + 1, math.floor(1.0001 * r["l2"]))
            lines.append(
                _verdict(
                    f"{r['dist']} n={r['n']:,} #{r['instance']}: <= max(L2 + 1, 1.0001 x L2)",
                    r["packs"] <= allowed,
                    f"{r['packs']:,} packs, L2 {r['l2']:,}, allowed {allowed:,}; best bound {r['best']:,}"
                    + (" (the target is out of reach)" if r["best"] > allowed else ""),
                )
            )
            continue
        if r["kind"] == "alpaca":
            lines.append(
                _verdict(
                    f"{r['data']} L={r['pack_size']}: <= L2 + 1",
                    r["packs"] <= r["l2"] + 1,
                    f"{r['packs']:,} packs, L2 {r['l2']:,} (bfd {r['fit_packs']:,})",
                )
            )
        if r["kind"] == "web":
            lines.append(
                _verdict(
                    f"{r['data']}: bfd + the phase <= 1.5 x bfd alone (same run)",
                    r["seconds"] <= 1.5 * r["fit_seconds"],
                    f"{_fmt(r['fit_seconds'])} -> {_fmt(r['seconds'])} ({r['seconds'] / r['fit_seconds']:.2f}x)",
                )
            )
            lines.append(
                _verdict(f"{r['data']}: bfd alone in <= 0.05 s", r["fit_seconds"] <= 0.05, _fmt(r["fit_seconds"]))
            )
        else:
            lines.append(
                _verdict(f"{r['data']} L={r['pack_size']} planned in <= 2 s", r["seconds"] <= 2.0, _fmt(r["seconds"]))
            )
    if histogram:
        lines.append(
            _verdict(
                f"{histogram['lengths']:,}-length histogram: < 1 s and < 1 GiB",
                histogram["seconds"] < 1.0 and histogram["peak_rss_gib"] < 1.0,
                f"{_fmt(histogram['seconds'])} (bfd alone {_fmt(histogram['fit_seconds'])}), peak RSS "
                f"{histogram['peak_rss_gib']:.2f} GiB; {histogram['fit_packs']:,} -> {histogram['packs']:,} packs, "
                f"L2 {histogram['l2']:,}",
            )
        )
    if big:
        lines.append(_verdict(f"{big['n']:,} lengths in <= 10 s", big["seconds"] <= 10.0, f"{big['seconds']:.2f} s"))
        lines.append(
            _verdict(
                f"{big['n']:,} lengths within 4 GiB",
                big["peak_rss_gib"] <= 4.0,
                f"{big['peak_rss_gib']:.2f} GiB peak RSS",
            )
        )
    return lines


# -- section: algorithms -----------------------------------------------------------------------
def algorithm_rows(cells: list[tuple[str, int]], repeats: int) -> list[dict]:
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
                f"{s.packs_over_lower_bound:.5f} eff {100 * s.efficiency:.3f}% {_fmt(seconds)}",
                flush=True,
            )
    return rows


# -- tables ------------------------------------------------------------------------------------
def print_tables(results: dict) -> None:
    if results.get("improve"):
        print("\n### The improvement phase: bfd alone -> bfd + the phase (same lengths, same run)\n")
        print(
            "| data | n | L | cp | packs - L2, mean | packs - L2, max | within L2 + 1 | proven optimal "
            "| over best bound, max | time (median) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in results["improve"]:
            k = r["instances"]
            print(
                f"| {r['dist']} | {r['n']:,} | {r['pack_size']} | {r['cp_size']} | "
                f"{r['fit_over_l2_mean']:.2f} -> **{r['over_l2_mean']:.2f}** | {r['fit_over_l2_max']} -> "
                f"{r['over_l2_max']} | {r['fit_at_l2_plus_1']} -> {r['at_l2_plus_1']} of {k} | "
                f"{r['fit_optimal']} -> {r['optimal']} of {k} | {r['over_best_max']} | "
                f"{_fmt(r['fit_seconds'])} -> {_fmt(r['seconds'])} |"
            )
    if results.get("peers"):
        print("\n### Side by side with the peers (cp 1, the first instance; time ratio = time / thdpack's)\n")
        print("| data | L | packer | packs - L2 | time | time ratio |")
        print("|---|---|---|---|---|---|")
        for r in sorted(results["peers"], key=lambda r: (r["data"], r["pack_size"], r.get("seconds", math.inf))):
            if "skipped" in r:
                print(f"| {r['data']} | {r['pack_size']} | {r['packer']} | - | - | {r['skipped']} |")
                continue
            note = "" if r["comparable"] else " (cuts sequences)"
            ratio = f"{r['time_vs_thdpack']:.1f}x" if r["time_vs_thdpack"] else "-"
            print(
                f"| {r['data']} | {r['pack_size']} | {r['packer']}{note} | {r['over_l2']:,} | "
                f"{_fmt(r['seconds'])} | {ratio} |"
            )
    if results.get("algorithms"):
        print("\n### thdpack's algorithms\n")
        print("| dist | n | algorithm | packs | L2 bound | packs / L2 | efficiency | time |")
        print("|---|---|---|---|---|---|---|---|")
        for r in results["algorithms"]:
            print(
                f"| {r['dist']} | {r['n']:,} | {r['algorithm']} | {r['packs']:,} | {r['l2']:,} | "
                f"{r['packs_over_l2']:.5f} | {100 * r['efficiency']:.3f}% | {_fmt(r['seconds'])} |"
            )


def _verdict(what: str, ok: bool, value: str) -> str:
    return f"{'PASS' if ok else 'MISS'}  {what}: {value}"


def _fmt(seconds: float) -> str:
    return f"{1e3 * seconds:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="seconds: 2 small instances per cell, 2 peers (the tests)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--shared", type=Path, default=REPO.parent / "shared", help="the project's shared folder")
    ap.add_argument("--instances", type=int, default=100, help="instances per cell of the before/after table")
    ap.add_argument("--repeats", type=int, default=7, help="best of this many runs for the timed targets")
    ap.add_argument("--peers", default=None, help="'none' or a comma list of harness peer names")
    ap.add_argument(
        "--peers-python", default=None, help="run the whole benchmark again under this interpreter (real TRL/axolotl)"
    )
    ap.add_argument(
        "--big", type=int, default=None, help="also plan this many web lengths in a fresh process (0: skip)"
    )
    ap.add_argument("--json", type=Path, default=HERE / "results" / "plan_bench.json")
    args = ap.parse_args(argv)
    if args.peers_python and Path(args.peers_python).resolve() != Path(sys.executable).resolve():
        forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--peers-python")]
        return subprocess.call([args.peers_python, __file__, *forwarded])
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; valid: {', '.join(SECTIONS)}")

    tiny = args.tiny
    n = 2000 if tiny else 100_000
    instances = 2 if tiny else args.instances
    large = 20_000 if tiny else 1_000_000
    repeats = 1 if tiny else args.repeats
    peers = args.peers or (TINY_PEERS if tiny else PEERS)
    big_n = args.big if args.big is not None else (0 if tiny else 100_000_000)
    pack_sizes, cp_sizes = [2048, 8192], [1, 2, 4]

    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}, numpy {np.__version__}"
    )
    data = Datasets(args.shared, n, tiny)
    missing = [d for d in IMPROVE_DISTS if d not in data.available()]
    if missing:
        print(f"not found under {args.shared / 'data'} (skipped): {', '.join(missing)}")
    results: dict = {"meta": {"tiny": tiny, "n": n, "instances": instances, "python": platform.python_version()}}
    if "improve" in sections:
        print("the improvement phase, before/after:")
        results["improve"] = improve_rows(data, pack_sizes, cp_sizes, instances)
    if "peers" in sections and peers != "none":
        harness = load_harness(args.shared)
        if harness is None:
            print(f"peers harness not found under {args.shared / 'peers'}: skipped")
        else:
            cells = [
                (f"{dist} #0", data.lengths(dist, pack_size, 0), pack_size)
                for dist in data.available()
                for pack_size in pack_sizes
                if dist != "stdlib"  # files longer than a pack: the peers cannot split them
            ]
            cells = cells[:1] if tiny else cells
            results["peers"] = peer_rows(harness, cells, peers, 1 if tiny else 3)
    histogram = big = None
    if "targets" in sections:
        print("targets:")
        results["targets"] = target_rows(data, large, 2 if tiny else 10, repeats)
        results["histogram"] = histogram = histogram_run(10**6 if tiny else 10**9)
        if big_n:
            results["big"] = big = big_run(big_n)
    if "algorithms" in sections:
        print("thdpack's algorithms:")
        cells = (
            [("web", large), ("uniform", n)]
            if tiny
            else [("web", large), ("sft", large), ("heavy", large), ("uniform", n)]
        )
        results["algorithms"] = algorithm_rows(cells, repeats)
    print_tables(results)
    verdicts = check_targets(results.get("improve", []), results.get("targets", []), histogram, big)
    if verdicts:
        print("\n### Targets\n")
        print("\n".join(verdicts))
    results["verdicts"] = verdicts
    results["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
