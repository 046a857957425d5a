"""The performance pages' tables and numbers, from the JSON the benchmarks wrote in docs/performance/.

``value(name)`` is ``{{ perf.<name> }}``: a Markdown table or one number. Each benchmark's
command sits beside its table on the page; rerunning it with ``--json docs/performance/<file>``
refreshes the page.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

PERFORMANCE = Path(__file__).resolve().parents[1] / "performance"
VALUES: dict[str, Callable[[], str]] = {}


def value(name: str) -> str:
    if name not in VALUES:
        raise KeyError(f"docs/gen/performance.py has no value {name!r}")
    return VALUES[name]()


def produces(name: str) -> Callable[[Callable[[], str]], Callable[[], str]]:
    def register(fn: Callable[[], str]) -> Callable[[], str]:
        VALUES[name] = fn
        return fn

    return register


@cache
def load(name: str) -> Any:
    return json.loads((PERFORMANCE / name).read_text())


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(str(c) for c in r) + " |" for r in rows)]) + "\n"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def ratio(x: float) -> str:
    return f"{x:.3f}" if x >= 0.01 else f"{x:.4f}"


# -- the planner: python benchmarks/plan_bench.py --json docs/performance/plan_bench.json ----------------
@produces("plan_improve")
def plan_improve() -> str:
    rows = []
    for r in load("plan_bench.json")["improve"]:
        rows.append(
            [
                r["dist"],
                f"{r['n']:,}",
                r["pack_size"],
                r["cp_size"],
                f"{r['fit_over_l2_mean']:.2f} → **{r['over_l2_mean']:.2f}**",
                f"{r['fit_over_l2_max']} → {r['over_l2_max']}",
                f"{r['fit_optimal']} → {r['optimal']}",
                f"{ms(r['fit_seconds'])} → {ms(r['seconds'])}",
            ]
        )
    header = ["data", "n", "L", "cp", "packs − L2, mean", "packs − L2, max", "proven optimal (of 100)", "median time"]
    return table(header, rows)


@produces("plan_peers")
def plan_peers() -> str:
    """One row per packer, one column per (data, L): packs over L2 / planning time (cp 1, the first draw)."""
    entries = load("plan_bench.json")["peers"]
    cells = list(dict.fromkeys((e["data"].removesuffix(" #0"), e["pack_size"]) for e in entries))
    packers = list(dict.fromkeys(e["packer"] for e in sorted(entries, key=lambda e: (e["kind"] != "candidate", 0))))
    found = {(e["packer"], e["data"].removesuffix(" #0"), e["pack_size"]): e for e in entries}
    kinds = {e["packer"]: e["kind"] for e in entries}
    rows = []
    for packer in packers:
        row = [f"{packer} ({kinds[packer]})" if kinds[packer] != "candidate" else f"**{packer}**"]
        for data, size in cells:
            e = found.get((packer, data, size))
            row.append("" if e is None else f"+{e['over_l2']:,} / {ms(e['seconds'])}")
        rows.append(row)
    return table(["packer", *(f"{data} L={size}" for data, size in cells)], rows)


@produces("plan_algorithms")
def plan_algorithms() -> str:
    rows = [
        [
            r["dist"],
            f"{r['n']:,}",
            r["pack_size"],
            r["algorithm"],
            f"{r['packs']:,}",
            f"{r['packs_over_l2']:.5f}",
            f"{100 * r['efficiency']:.3f}%",
            ms(r["seconds"]),
        ]
        for r in load("plan_bench.json")["algorithms"]
    ]
    return table(["data", "n", "L", "algorithm", "packs", "packs / L2", "efficiency", "time"], rows)


@produces("plan_targets")
def plan_targets() -> str:
    return (
        "\n".join(
            f"- {'**met**' if v.startswith('PASS') else '**missed**'}: {v[4:].strip()}"
            for v in load("plan_bench.json")["verdicts"]
        )
        + "\n"
    )


# -- THD batches: python benchmarks/thd_bench.py --json docs/performance/thd_bench.json --------------------
def _us(value: float | None) -> str:
    return "" if value is None else (f"{value:,.0f} µs" if value < 10_000 else f"{value / 1e3:,.1f} ms")


@produces("thd_table")
def thd_table() -> str:
    data = load("thd_bench.json")
    rows = []
    for r in data["rows"]:
        if "median_us" not in r:
            continue  # a CUDA row measured only where CUDA is
        ratio_row = "(x 1000)" in r["stage"]
        median = f"{r['median_us'] / 1e3:.2f}x" if ratio_row else _us(r["median_us"])
        target = (
            "" if r.get("target_us") is None else (f"{r['target_us'] / 1e3:.1f}x" if ratio_row else _us(r["target_us"]))
        )
        rows.append([r["stage"].replace(" (x 1000)", ""), median, _us(r.get("p10_us")), _us(r.get("p90_us")), target])
    return table(["stage", "median", "p10", "p90", "target"], rows)


@produces("thd_config")
def thd_config() -> str:
    data = load("thd_bench.json")
    c = data["config"]
    return (
        f"{c['packs']} packs x {c['pack_size']:,} tokens ({data['num_sequences']} sequences), cp_size {c['cp_size']}, "
        f"{c['threads']} torch thread, medians of {c['reps']} repetitions; torch {data['torch']}, {data['device']}"
    )


# -- attention: python benchmarks/attention_bench.py --json docs/performance/attention_bench.json -----------
@produces("attention_table")
def attention_table() -> str:
    rows = [
        [
            r["pack_size"],
            r["sequences"],
            f"`{r['backend']}`",
            ms(r["forward_s"]),
            "" if r.get("forward_backward_s") is None else ms(r["forward_backward_s"]),
        ]
        for r in load("attention_bench.json")["timings"]
    ]
    return table(["tokens", "sequences", "backend", "forward", "forward + backward"], rows)


@produces("attention_config")
def attention_config() -> str:
    d = load("attention_bench.json")
    heads = d["heads"]
    return (
        f"torch {d['torch']} on the {d['device']}, {d['threads']} threads, {d['dtype'].removeprefix('torch.')}, "
        f"{heads[0]} query / {heads[1]} KV heads of {heads[2]}"
    )


# -- the streaming packer: python benchmarks/packer_bench.py --quick --json docs/performance/packer_bench.json
@produces("packer_table")
def packer_table() -> str:
    rows = [
        [
            r["data"],
            f"{r['n']:,}",
            r["pack_size"],
            r["packer"],
            f"{100 * r['efficiency']:.2f}%",
            f"{r['packs_over_l2']:.5f}",
            "" if r["samples_per_s"] is None else f"{r['samples_per_s']:,.0f}",
        ]
        for r in load("packer_bench.json")["streaming"]
    ]
    return table(["data", "n", "L", "packer", "efficiency", "packs / L2", "samples/s"], rows)


# -- CP load balance: python benchmarks/cp_balance.py --json docs/performance/cp_balance.json ---------------
def _mib(x: float) -> str:
    return f"{x / 2**20:.1f}" if x < 10 * 2**20 else f"{x / 2**20:.0f}"


@produces("cp_balance_table")
def cp_balance_table() -> str:
    rows = []
    for r in load("cp_balance.json")["rows"]:
        te, ad, a2a = r["te"], r["adaptive"], r["a2a"]
        rows.append(
            [
                r["data"],
                r["pack_size"],
                r["cp_size"],
                f"**{ratio(ad['tiles_vs_te'])}**",
                f"{ad['pairs_vs_te']:.3f}",
                ratio(a2a["tiles_vs_te"]),
                f"{ad['tiles_max_over_mean']:.3f} / {ad['tokens_max_over_mean']:.3f}",
                f"{100 * te['cp_padding']:.2f}% → {100 * ad['cp_padding']:.2f}%",
                f"{te['packs']} → {ad['packs']}",
                f"{_mib(te['kv_bytes_per_pack'])} → {_mib(ad['kv_bytes_per_pack'])} ({_mib(a2a['kv_bytes_per_pack'])})",
            ]
        )
    header = [
        "data",
        "L",
        "cp",
        "`adaptive` tiles vs `te`",
        "pairs vs `te`",
        "`a2a` tiles vs `te`",
        "tiles / tokens max/mean (adaptive)",
        "CP padding `te` → `adaptive`",
        "packs `te` → `adaptive`",
        "MiB / layer / pack `te` → `adaptive` (`a2a`)",
    ]
    return table(header, rows)


@produces("cp_balance_range")
def cp_balance_range() -> str:
    values = [r["adaptive"]["tiles_vs_te"] for r in load("cp_balance.json")["rows"]]
    return f"{ratio(min(values))}-{ratio(max(values))}x"


@produces("cp_balance_targets")
def cp_balance_targets() -> str:
    """DESIGN.md's CP targets, checked against the table's rows."""
    rows = load("cp_balance.json")["rows"]

    def pick(data: str, cp: int) -> dict:
        return next(r for r in rows if r["data"].startswith(data) and r["cp_size"] == cp)

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**missed**"

    mix8 = pick("long-tail", 8)["adaptive"]["tiles_vs_te"]
    alpaca = {cp: pick("alpaca", cp)["adaptive"]["tiles_vs_te"] for cp in (4, 8, 16)}
    a2a4 = pick("alpaca", 4)["a2a"]["tiles_vs_te"]
    worst = max(r["adaptive"]["tiles_vs_te"] for r in rows)
    spread = max(max(r["adaptive"]["tiles_max_over_mean"], r["adaptive"]["tokens_max_over_mean"]) for r in rows)
    padding = pick("alpaca", 4)["adaptive"]["cp_padding"]
    lines = [
        f"- busiest rank's tiles <= 0.75x `te` on the long-tail mix at cp 8: {ratio(mix8)}, {verdict(mix8 <= 0.75)}",
        *(f"- <= 0.05x on Alpaca at cp {cp}: {ratio(x)}, {verdict(x <= 0.05)}" for cp, x in alpaca.items()),
        f"  (all-to-all, every record whole for a quarter of the heads at cp 4, perfectly balanced: {ratio(a2a4)})",
        f"- never above 1.0x `te`: at most {ratio(worst)}, {verdict(worst <= 1.0)}",
        f"- max / mean tiles and tokens <= 1.02: at most {spread:.3f}, {verdict(spread <= 1.02)}",
        f"- CP padding <= 0.5% on Alpaca at cp 4: {100 * padding:.2f}%, {verdict(padding <= 0.005)}",
    ]
    return "\n".join(lines) + "\n"


@produces("cp_planner_timing")
def cp_planner_timing() -> str:
    data = load("cp_planner_timing.json")
    rows = []
    for engine, runs in data["runs"].items():
        cases = {}
        for run in runs:
            for case in run:
                cases.setdefault((case["pack_size"], case["cp_size"]), []).append(case)
        for (size, cp), found in cases.items():
            plan = [c["adaptive_seconds"] for c in found]
            place = [c["placement_seconds"] for c in found]
            share = [c["placement_seconds"] / c["adaptive_seconds"] for c in found]
            rows.append(
                [
                    engine,
                    f"{size}, {cp}",
                    f"{ms(min(plan))}-{ms(max(plan))}",
                    f"{ms(min(place))}-{ms(max(place))}",
                    f"**{100 * min(share):.1f}-{100 * max(share):.1f}%**",
                ]
            )
    header = ["engine", "L, cp", "`adaptive` plan", "placing the long packs' templates", "share of the plan"]
    return table(header, rows) + f"\n{data['note']}.\n"


# -- training throughput: python benchmarks/train_throughput.py --cpu ----------------------------------------
LAYOUTS = ("padding", "grouped", "packed", "concat", "ideal")


@produces("train_throughput_table")
def train_throughput_table() -> str:
    rows = []
    for run in load("train_throughput_cpu.json")["runs"]:
        m = run["modes"]
        tok = {k: m[k]["tokens_per_s"] for k in LAYOUTS}
        cells = [f"{tok[k]:,.0f} tok/s, {100 * m[k]['padding']:.1f}% pad" for k in ("padding", "grouped")]
        cells += [f"**{tok['packed']:,.0f}**", f"{tok['concat']:,.0f}", f"{tok['ideal']:,.0f}"]
        ratios = [tok["packed"] / tok["padding"], tok["packed"] / tok["grouped"], tok["packed"] / tok["ideal"]]
        rows.append([run["data"], run["pack_size"], *cells, *(f"{x:.2f}" for x in ratios)])
    header = ["data", "L", "(a) padding", "(b) grouped", "(c) thdpack", "(d) concat", "(e) ideal", "c/a", "c/b", "c/e"]
    return table(header, rows)


@produces("train_throughput_config")
def train_throughput_config() -> str:
    d = load("train_throughput_cpu.json")
    model = d["config"]["model"]
    return (
        f"{d['device_name']}, torch {d['torch']}, {d['precision']}, {d['threads']} thread; a "
        f"{d['parameters'] / 1e6:.1f}M-parameter decoder (dim {model['dim']}, {model['n_layers']} layers, "
        f"{model['vocab_size']:,}-word vocabulary); {d['config']['step_tokens']:,} real tokens a step, medians of "
        f"{d['config']['steps']} steps after {d['config']['warmup']} warm-up; {d['wall_s'] / 60:.1f} min"
    )


CP_THROUGHPUT_RUNS = ("cp_throughput_cpu.json", "cp_throughput_cpu_rerun.json")


@produces("cp_throughput_table")
def cp_throughput_table() -> str:
    rows = []
    for run in CP_THROUGHPUT_RUNS:
        for block in load(run):
            modes = {r["mode"]: r for r in block["rows"]}
            first = block["rows"][0]
            cells = [
                f"{modes[m]['step_s_median']:.2f} s ({min(modes[m]['step_s']):.1f}-{max(modes[m]['step_s']):.1f})"
                for m in ("te", "adaptive", "a2a")
            ]
            speedups = [f"**{modes['adaptive']['vs_te']:.2f}x**", f"{modes['a2a']['vs_te']:.2f}x"]
            rows.append([f"`{run}`", first["data"], first["pack_size"], first["cp_size"], *cells, *speedups])
    header = [
        "run",
        "data",
        "L",
        "cp",
        "`te` step (range)",
        "`adaptive` step",
        "`a2a` step",
        "`adaptive` over `te`",
        "`a2a` over `te`",
    ]
    return table(header, rows)


def _speedup(data: str) -> str:
    """``adaptive``'s speed-up over ``te`` on ``data`` in the benchmark run (the first file)."""
    for block in load(CP_THROUGHPUT_RUNS[0]):
        if block["rows"][0]["data"].startswith(data):
            return f"{next(r['vs_te'] for r in block['rows'] if r['mode'] == 'adaptive'):.2f}x"
    raise KeyError(f"{CP_THROUGHPUT_RUNS[0]} has no {data!r} rows")


VALUES["cp_throughput_alpaca_speedup"] = lambda: _speedup("alpaca")
VALUES["cp_throughput_stdlib_speedup"] = lambda: _speedup("python311_stdlib")


@produces("cp_throughput_config")
def cp_throughput_config() -> str:
    block = load(CP_THROUGHPUT_RUNS[0])[0]
    c, model = block["config"], block["config"]["model"]
    return (
        f"{block['device']}, torch {block['torch']}, fp32; the decoder with dim {model['dim']}, {model['n_layers']} "
        f"layers, a {model['vocab_size']:,}-word vocabulary; L {c['pack_size']}, {c['packs_per_step']} packs per step, "
        f"medians of {c['steps']} steps after {c['warmup']} warm-up"
    )


# -- the step-time model: python benchmarks/cp_auto.py, benchmarks/mesh_vs_fixed.py ----------------------------
@produces("cp_auto_table")
def cp_auto_table() -> str:
    rows = []
    for r in load("cp_auto.json")["rows"]:
        auto = r["auto"]
        best_other = min(r[m]["seconds"] for m in ("te", "adaptive", "a2a"))
        chosen = auto["chosen"]
        rows.append(
            [
                r["data"],
                r["pack_size"],
                r["cp_size"],
                f"{r['te']['seconds']:.1f}",
                f"{r['adaptive']['vs_te']:.3f}",
                f"{r['a2a']['vs_te']:.3f}",
                f"**{auto['vs_te']:.3f}**",
                f"{auto['seconds'] / best_other:.3f}",
                f"{auto['seconds'] / r['adaptive']['seconds']:.3f}",
                f"{chosen['adaptive']} / {chosen['te']} / {chosen['a2a']}",
                auto["violations"],
            ]
        )
    header = [
        "data",
        "L",
        "cp",
        "`te` s",
        "`adaptive` / `te`",
        "`a2a` / `te`",
        "`auto` / `te`",
        "`auto` / best other",
        "`auto` / `adaptive`",
        "auto's packs: placement / TE / a2a",
        "violations",
    ]
    return table(header, rows)


@produces("cp_auto_config")
def cp_auto_config() -> str:
    d = load("cp_auto.json")
    return f"model {d['model']} on the `{d['profile']}` profile"


@produces("mesh_vs_fixed_table")
def mesh_vs_fixed_table() -> str:
    rows = []
    for r in load("mesh_vs_fixed.json")["rows"]:
        best, mesh = r["best_fixed"], r["mesh"]
        rows.append(
            [
                r["data"],
                r["gpus"],
                f"{best['mode']} dp {best['dp']} x cp {best['cp']} ({best['comm']})",
                f"{best['tokens_per_s_per_gpu']:,.0f}",
                f"{mesh['tokens_per_s_per_gpu']:,.0f}",
                f"**{r['mesh_vs_best_fixed']:.3f}**",
            ]
        )
    header = ["data", "GPUs", "best fixed mode", "tokens/s/GPU", "`mesh` tokens/s/GPU", "`mesh` / best fixed"]
    return table(header, rows)


@produces("cp_model_check_table")
def cp_model_check_table() -> str:
    d = load("cp_model_check_cpu.json")
    rows = [
        [
            r["run"],
            r["data"],
            r["mode"],
            f"{r['measured_step_s']:.2f} s",
            f"{r['predicted_step_s']:.2f} s",
            f"{r['measured_vs_te']:.3f}",
            f"{r['predicted_vs_te']:.3f}",
            f"{100 * r['error']:.1f}%",
        ]
        for r in d["rows"]
    ]
    header = [
        "run",
        "data",
        "mode",
        "measured step",
        "modelled step",
        "measured / `te`",
        "modelled / `te`",
        "ratio error",
    ]
    return table(header, rows) + f"\nTarget: the ratio error within {100 * d['target']:.0f}%.\n"
