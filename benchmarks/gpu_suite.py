"""One command for the GPU: GPU tests, attention parity, simulated CP, CP placement timings, THD timings, throughput.

    python benchmarks/gpu_suite.py --out DIR                             # one H100: at most about 8 minutes
    python benchmarks/gpu_suite.py --tiny --skip-pytest --out /tmp/suite  # CPU, tiny sizes (the tests run this)

Sections, in order; each one ran, was skipped (with its reason) or failed (with its error), and a
failing section never stops the ones after it:

1. ``pytest``: ``pytest -m gpu -q tests`` in a subprocess; its summary line. ``--skip-pytest``
   leaves it out (the test suite runs this script, and pytest inside pytest would recurse).
2. ``attention_parity``: every backend (te, flash, varlen, flex, sdpa, math) on bf16 q/k/v
   against the fp64 ``reference_attention``: max |error| of out, dq, dk, dv over real tokens and
   its ratio to plain PyTorch bf16 attention's error (DESIGN.md's target: ratio <= 2). A backend
   the selector refuses here (missing package, wrong device) is skipped with its reason.
3. ``cp_simulated``: ``simulated_ring_attention`` (every CP rank's shard through the ring
   schedule, in one process) with FlashAttention-2 tiles on CUDA (exact math tiles on the CPU),
   cp 2 / 4 / 8, bf16, against the same unsharded fp64 reference and ratio.
4. ``cp_placement``: the busiest CP rank's attention time (forward + backward) per pack, summed
   over the packs, of Transformer Engine's layout (``te``: every sequence split over all ranks)
   against thdpack's per-sequence placement (``adaptive``: short sequences whole on one rank, long
   ones split over a group) and the all-to-all (``a2a``, on either plan's packs), on one plan each
   over the same sequences (Alpaca lengths, or a synthetic lognormal where they are absent), L 8192,
   cp 2 / 4 / 8, Llama-3-8B attention heads in bf16: each rank's shard timed alone with the real
   tiles (FlashAttention-2 on CUDA, exact math tiles on the CPU), its ring's peers echoed; the
   communication is not timed (``cp_rank_timing.py`` says why the tile work is exact).
5. ``calibrate``: ``thdpack calibrate`` in this process on the device, for ``cp_placement``'s
   attention heads and backend: the device's profile (kernels, matmuls, memory, one eager op;
   links come from the base profile: one process), ``profile.json``.
6. ``model_check``: the step model on that profile predicts ``cp_placement``'s busiest-rank times
   (``cp_rank_model.py``: the same packs, each rank's attention and the host ops of its calls, no
   exchange); measured against modelled per CP size and mode.
7. ``thd_timings``: ``thd_collate`` (host, one thread, as in a DataLoader worker), ``thd_to_device``
   (pinned, non-blocking), ``cp.shard`` and ``partition_indices`` (about 1M tokens) on the device.
8. ``throughput``: ``train_throughput.py``'s table (its functions, fewer timed steps).

Writes ``results.json`` (everything, with the device, torch / CUDA versions and each section's
status), ``results.md`` (the tables), ``throughput.png`` and ``attention_parity.png`` into
``--out``, plus ``profile.json`` from section 5 and ``throughput.json`` / ``.md`` from section 8.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

import attention_bench  # noqa: E402
import cp_rank_model  # noqa: E402
import cp_rank_timing  # noqa: E402
import thd_bench  # noqa: E402
import train_throughput  # noqa: E402

from thdpack.attention import reference_attention, simulated_ring_attention, thd_attention  # noqa: E402
from thdpack.calibrate.command import calibrate, default_base  # noqa: E402
from thdpack.cp import partition_indices, shard  # noqa: E402
from thdpack.perf.machine import MachineProfile, load_profile  # noqa: E402
from thdpack.perf.shape import ModelShape  # noqa: E402
from thdpack.thd import thd_collate, thd_to_device  # noqa: E402

SEED = 1234
BACKENDS = ("te", "flash", "varlen", "flex", "sdpa", "math")
CP_SIZES = (2, 4, 8)
PARITY_TARGET = 2.0
"""bf16 error of a backend / bf16 error of plain PyTorch attention, at most (DESIGN.md)."""
BUDGET_S = 480
"""The suite's time budget on one H100 (the issue's 8 minutes)."""
SECTIONS = ("pytest", "attention_parity", "cp_simulated", "cp_placement", "calibrate", "model_check", "thd_timings",
            "throughput")  # fmt: skip
CALIBRATE_BUDGET_S = {True: 10.0, False: 45.0}
"""Seconds ``calibrate`` may spend, ``--tiny`` and not."""


class Skipped(Exception):
    """A section that cannot run here; its message is the reason."""


def run_section(name: str, fn: Callable[[], dict[str, Any]], say: Callable[[str], None]) -> dict[str, Any]:
    """``{"status": "ran", **fn()}``, or ``skipped`` with the reason, or ``failed`` with the error."""
    say(f"== {name}")
    start = time.perf_counter()
    try:
        entry = {"status": "ran", **fn()}
    except Skipped as why:
        entry = {"status": "skipped", "reason": str(why)}
    except Exception as err:  # a failing section is reported; the suite goes on
        entry = {"status": "failed", "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    entry["seconds"] = time.perf_counter() - start
    say(f"   {entry['status']} in {entry['seconds']:.1f} s" + _why(entry))
    return entry


def _why(entry: Mapping[str, Any]) -> str:
    if entry["status"] == "skipped":
        return f": {entry['reason']}"
    if entry["status"] == "failed":
        return f": {entry['error']}"
    return ""


# ---------------------------------------------------------------------------------------------
# 1. pytest -m gpu


def gpu_tests(timeout_s: int) -> dict[str, Any]:
    """``pytest -m gpu -q tests`` in a subprocess (repo on PYTHONPATH); fails when a test fails."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # a module that cannot be imported there (a missing optional package) must not hide the GPU tests
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    command += ["--continue-on-collection-errors", "tests"]
    try:
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"pytest ran past --pytest-timeout={timeout_s} s") from err
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    summary = lines[-1] if lines else proc.stderr.strip()[-300:]
    body = {"command": " ".join(command), "returncode": proc.returncode, "summary": summary}
    if proc.returncode not in (0, 5):  # 5: no test selected (none is marked gpu)
        raise RuntimeError(f"pytest exited with {proc.returncode}: {summary}\n{proc.stdout[-3000:]}")
    return body


# ---------------------------------------------------------------------------------------------
# 2. and 3. bf16 parity against fp64


def parity_case(device: torch.device, tiny: bool) -> tuple[dict[str, Any], tuple[torch.Tensor, ...], dict[str, Any]]:
    """A packed SFT-like batch (slots multiples of 16, so cp 8 can shard it) and fp64 q, k, v."""
    pack_size, heads, kv_heads, head_dim = (1024, 4, 2, 32) if tiny else (4096, 16, 8, 64)
    batch = attention_bench.make_batch(pack_size, 2 * max(CP_SIZES), SEED)
    thd = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    g = torch.Generator(device=device).manual_seed(SEED)
    qkv = tuple(
        torch.randn(pack_size, n, head_dim, generator=g, device=device, dtype=torch.float64)
        for n in (heads, kv_heads, kv_heads)
    )
    shape = {"tokens": pack_size, "sequences": len(batch["cu_seqlens"]) - 1, "heads": [heads, kv_heads, head_dim]}
    return thd, qkv, shape


def _verdict(errors: Mapping[str, float]) -> dict[str, Any]:
    worst = max(errors[f"{name}_vs_plain_bf16"] for name in ("out", "dq", "dk", "dv"))
    return {**errors, "worst_ratio": worst, "met": worst <= PARITY_TARGET}


def plain_bf16_errors(thd: dict[str, Any], qkv: tuple[torch.Tensor, ...]) -> dict[str, float]:
    """Errors of plain PyTorch attention run in bf16 (the reference's own ops) against fp64."""
    return attention_bench.bf16_errors(thd, qkv, lambda q, k, v: reference_attention(q, k, v, thd)[0], None)


def attention_parity(device: torch.device, tiny: bool) -> dict[str, Any]:
    thd, qkv, shape = parity_case(device, tiny)
    plain = plain_bf16_errors(thd, qkv)
    rows = [{"method": "plain torch bf16", **plain}]
    for backend in BACKENDS:
        try:
            errors = attention_bench.bf16_errors(
                thd, qkv, lambda q, k, v, b=backend: thd_attention(q, k, v, thd, backend=b), plain
            )
        except Exception as err:  # the backend's row says why; the others still run
            rows.append({"method": backend, **attention_bench.outcome(err)})
            continue
        rows.append({"method": backend, **_verdict(errors)})
    return {"case": shape, "target": PARITY_TARGET, "rows": rows}


def cp_simulated(device: torch.device, tiny: bool) -> dict[str, Any]:
    kernel = "flash" if device.type == "cuda" else "math"
    thd, qkv, shape = parity_case(device, tiny)
    plain = plain_bf16_errors(thd, qkv)
    rows = []
    for cp_size in CP_SIZES:

        def ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int = cp_size) -> torch.Tensor:
            return simulated_ring_attention(q, k, v, thd, cp_size=cp, kernel=kernel)[0]

        start = time.perf_counter()
        try:
            errors = attention_bench.bf16_errors(thd, qkv, ring, plain)
        except Exception as err:
            rows.append({"cp_size": cp_size, "kernel": kernel, **attention_bench.outcome(err)})
            continue
        rows.append({"cp_size": cp_size, "kernel": kernel, **_verdict(errors), "seconds": time.perf_counter() - start})
    return {"case": shape, "target": PARITY_TARGET, "plain_bf16": plain, "rows": rows}


# ---------------------------------------------------------------------------------------------
# 4. CP placement: the busiest rank's attention time


def cp_placement(device: torch.device, tiny: bool, say: Callable[[str], None]) -> dict[str, Any]:
    """``cp_rank_timing.measure``: te vs adaptive vs a2a, the busiest rank's forward + backward."""
    try:
        return cp_rank_timing.measure(device, tiny, say)
    except cp_rank_timing.Unavailable as why:
        raise Skipped(str(why)) from why


# ---------------------------------------------------------------------------------------------
# 5. and 6. the device's profile, and the step model against cp_placement


def calibrate_device(device: torch.device, tiny: bool, out: Path) -> dict[str, Any]:
    """``thdpack calibrate`` in this process for cp_placement's attention (its heads, dtype, backend
    and pack share per rank): ``profile.json``."""
    case = cp_rank_timing.TINY if tiny else cp_rank_timing.GPU
    try:
        backend, _ = cp_rank_timing.choose_backend(device, case)
    except cp_rank_timing.Unavailable as why:
        raise Skipped(str(why)) from why
    shape = ModelShape(layers=1, hidden=case.heads * case.head_dim, ffn=4 * case.heads * case.head_dim,
                       heads=case.heads, kv_heads=case.kv_heads, head_dim=case.head_dim, vocab=32000)  # fmt: skip
    profile = calibrate(shape, device=device, dtype=case.dtype, backend=backend,
                        rank_tokens=case.pack_size // min(case.cp_sizes), base=load_profile(default_base(device)),
                        budget_s=CALIBRATE_BUDGET_S[tiny], repeats=max(3, case.repeats))  # fmt: skip
    profile.to_json(out / "profile.json")
    return {"profile": "profile.json", "backend": backend, "host_op_us": 1e6 * profile.host.op_s,
            "peak_flops": profile.peak_flops, "memory_bandwidth": profile.memory_bandwidth,
            "attention_forward_causal": profile.attention.forward_causal}  # fmt: skip


def model_check(results: dict[str, Any], tiny: bool, out: Path) -> dict[str, Any]:
    """cp_placement's busiest-rank times predicted from ``calibrate``'s profile (``cp_rank_model``)."""
    sections = results["sections"]
    if sections["cp_placement"]["status"] != "ran":
        raise Skipped("cp_placement did not run: nothing measured to check against")
    ran = sections["calibrate"]["status"] == "ran"
    profile: MachineProfile = load_profile(out / "profile.json") if ran else load_profile(default_base(
        torch.device(results["device"])))  # fmt: skip
    case = cp_rank_timing.TINY if tiny else cp_rank_timing.GPU
    _, lengths = cp_rank_timing.lengths_of_data(case)
    predicted = cp_rank_model.predict(profile, case, lengths)
    return {"profile": profile.name, "profile_source": "calibrated here" if ran else "shipped: calibrate did not run",
            "rows": cp_rank_model.compare(sections["cp_placement"]["rows"], predicted)}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 7. THD batch timings


def thd_timings(device: torch.device, tiny: bool) -> dict[str, Any]:
    packs_n, pack_size, cp_size, reps = (2, 1024, 2, 20) if tiny else (8, 8192, 2, 200)
    tokens, seqs = (1 << 16, 1000) if tiny else (1 << 20, 10_000)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the host stages run in a DataLoader worker: one thread
    try:
        packs = thd_bench.make_packs(packs_n, pack_size, cp_size)
        host = thd_collate(packs)
        collate = f"thd_collate ({packs_n} packs x {pack_size}, one thread)"
        rows = [_timing(collate, "cpu", thd_bench.time_cpu(lambda: thd_collate(packs), reps))]
    finally:
        torch.set_num_threads(threads)
    if device.type == "cuda":
        pinned = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in host.items()}
        on_device = thd_to_device(pinned, device)
        rows.append(
            _timing(
                "thd_to_device (pinned, non-blocking)",
                "cuda",
                _time(lambda: thd_to_device(pinned, device), reps, device),
            )
        )
    else:
        on_device = host
        rows.append({"stage": "thd_to_device (pinned, non-blocking)", "device": "cpu", "skipped": "no copy on the CPU"})
    rows.append(
        _timing(
            f"cp.shard (cp {cp_size}, rank 0)", device.type, _time(lambda: shard(on_device, cp_size, 0), reps, device)
        )
    )
    cu = thd_bench.partition_case(tokens, seqs, cp_size).to(device)
    total = int(cu[-1])
    rows.append(
        _timing(
            f"partition_indices ({total:,} tokens, {seqs:,} sequences, cp {cp_size})",
            device.type,
            _time(lambda: partition_indices(cu, total, cp_size, 0), reps, device),
        )
    )
    return {"batch": {"packs": packs_n, "pack_size": pack_size, "cp_size": cp_size}, "rows": rows}


def _time(fn: Callable[[], object], reps: int, device: torch.device) -> dict[str, float]:
    return thd_bench.time_cuda(fn, reps) if device.type == "cuda" else thd_bench.time_cpu(fn, reps)


def _timing(stage: str, device: str, stats: Mapping[str, float]) -> dict[str, Any]:
    return {"stage": stage, "device": device, **stats}


# ---------------------------------------------------------------------------------------------
# 8. training throughput


def throughput(device: torch.device, tiny: bool, out: Path, say: Callable[[str], None]) -> dict[str, Any]:
    base = train_throughput.TINY if tiny else train_throughput.ThroughputConfig()
    cfg = base if tiny else replace(base, steps=4)  # on the GPU: 4 timed steps, the 8-minute budget
    result = train_throughput.run(train_throughput.DATASETS, cfg, device, say=say)
    paths = train_throughput.write(result, out, stem="throughput")
    return {"result": result, "files": [p.name for p in paths]}


# ---------------------------------------------------------------------------------------------
# Reports


def _e(value: Any) -> str:
    return f"{value:.2e}" if isinstance(value, float) else "-"


def markdown(results: Mapping[str, Any]) -> str:
    s = results["sections"]
    lines = [
        f"# GPU suite on {results['device_name']} ({results['device']})",
        "",
        f"torch {results['torch']}, CUDA {results['cuda']}, {'--tiny, ' if results['tiny'] else ''}"
        f"{results['wall_s']:.0f} s in all (budget on one H100: {BUDGET_S} s).",
        "",
        "| section | status | seconds | note |",
        "|---|---|---|---|",
    ]
    for name in SECTIONS:
        entry = s[name]
        note = (_why(entry)[2:] or entry.get("summary", "")).split("\n")[0]
        lines.append(f"| {name} | {entry['status']} | {entry['seconds']:.1f} | {note[:160].replace('|', '/')} |")
    for name in SECTIONS:
        if s[name]["status"] == "failed":
            lines += ["", f"## {name} failed", "", "```", s[name]["error"][-4000:], "```"]
    for name in ("attention_parity", "cp_simulated"):
        if s[name]["status"] != "ran":
            continue
        case = s[name]["case"]
        lines += [
            "",
            f"## {name}: bf16 max |error| vs fp64 reference_attention ({results['device']})",
            "",
            f"{case['tokens']} tokens, {case['sequences']} sequences, heads {case['heads'][0]} / {case['heads'][1]} "
            f"x {case['heads'][2]}; ratio = error / plain PyTorch bf16's error, target <= {PARITY_TARGET:g}.",
            "",
            "| method | out | dq | dk | dv | worst ratio | verdict |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in s[name]["rows"]:
            method = row.get("method") or f"ring cp={row['cp_size']} ({row['kernel']} tiles)"
            if "skipped" in row or "failed" in row:
                key = "failed" if "failed" in row else "skipped"
                lines.append(f"| {method} | {key}: {row[key][:100].replace('|', '/')} | | | | | |")
                continue
            ratio = f"{row['worst_ratio']:.2f}" if "worst_ratio" in row else "1 (itself)"
            verdict = ("met" if row["met"] else "missed") if "met" in row else "-"
            cells = " | ".join(_e(row[k]) for k in ("out", "dq", "dk", "dv"))
            lines.append(f"| {method} | {cells} | {ratio} | {verdict} |")
    if s["cp_placement"]["status"] == "ran":
        lines += ["", f"## cp_placement: the busiest CP rank's attention time ({results['device']})", ""]
        lines += cp_rank_timing.markdown(s["cp_placement"])
    if s["model_check"]["status"] == "ran":
        lines += ["", f"## model_check: the step model against cp_placement ({results['device']})", ""]
        lines += cp_rank_model.markdown(s["model_check"])
    if s["thd_timings"]["status"] == "ran":
        lines += ["", "## thd_timings", "", "| stage | device | median us | p10 us | p90 us |", "|---|---|---|---|---|"]
        for row in s["thd_timings"]["rows"]:
            if "skipped" in row:
                lines.append(f"| {row['stage']} | {row['device']} | {row['skipped']} | | |")
                continue
            lines.append(
                f"| {row['stage']} | {row['device']} | {row['median_us']:,.1f} | {row['p10_us']:,.1f} | "
                f"{row['p90_us']:,.1f} |"
            )
    if s["throughput"]["status"] == "ran":
        lines += ["", "## throughput", "", train_throughput.markdown(s["throughput"]["result"])]
    return "\n".join(lines) + "\n"


def plot_parity(results: Mapping[str, Any], path: Path) -> str | None:
    """Bars of each method's worst bf16 error ratio, with the target line; why not when it cannot."""
    bars = []
    for name in ("attention_parity", "cp_simulated"):
        entry = results["sections"][name]
        for row in entry.get("rows", []) if entry["status"] == "ran" else []:
            if "worst_ratio" in row:
                bars.append((row.get("method") or f"ring cp={row['cp_size']}", row["worst_ratio"]))
    if not bars:
        return "no parity plot: no backend ran"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        return f"no parity plot: matplotlib is not installed ({err})"
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(bars)), 3.5))
    ax.bar([b[0] for b in bars], [b[1] for b in bars])
    ax.axhline(PARITY_TARGET, color="red", linestyle="--", label=f"target {PARITY_TARGET:g}")
    ax.set_ylabel("bf16 error / plain bf16 error (worst of out, dq, dk, dv)", fontsize=7)
    ax.set_title(f"bf16 attention parity vs fp64: {results['device_name']}", fontsize=9)
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", labelsize=7, rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory for results.json, results.md, PNGs")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU (about a minute; the tests)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--skip-pytest", action="store_true", help="leave out section 1 (when pytest runs this)")
    parser.add_argument("--pytest-timeout", type=int, default=240, help="seconds for the gpu-marked tests")
    args = parser.parse_args(argv)
    device = train_throughput.choose_device(args.device, args.tiny)
    if device.type == "cpu":
        torch.set_num_threads(1)  # steadier timings on a shared CPU
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results: dict[str, Any] = {
        "device": device.type,
        "device_name": train_throughput.device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "tiny": args.tiny,
        "sections": {},
    }
    say = print
    say(f"gpu_suite on {results['device_name']}, torch {results['torch']}, CUDA {results['cuda']}")

    def pytest_section() -> dict[str, Any]:
        if args.skip_pytest:
            raise Skipped("--skip-pytest (the test suite runs this script; pytest inside it would recurse)")
        return gpu_tests(args.pytest_timeout)

    sections: dict[str, Callable[[], dict[str, Any]]] = {
        "pytest": pytest_section,
        "attention_parity": lambda: attention_parity(device, args.tiny),
        "cp_simulated": lambda: cp_simulated(device, args.tiny),
        "cp_placement": lambda: cp_placement(device, args.tiny, say),
        "calibrate": lambda: calibrate_device(device, args.tiny, args.out),
        "model_check": lambda: model_check(results, args.tiny, args.out),
        "thd_timings": lambda: thd_timings(device, args.tiny),
        "throughput": lambda: throughput(device, args.tiny, args.out, say),
    }
    for name, fn in sections.items():
        results["sections"][name] = run_section(name, fn, say)
    results["wall_s"] = time.perf_counter() - start
    results["skipped"] = {n: e["reason"] for n, e in results["sections"].items() if e["status"] == "skipped"}
    results["failed"] = {n: e["error"] for n, e in results["sections"].items() if e["status"] == "failed"}
    problem = plot_parity(results, args.out / "attention_parity.png")
    if problem:
        results["parity_plot"] = problem
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    text = markdown(results)
    (args.out / "results.md").write_text(text)
    print()
    print(text)
    print(f"wrote {args.out}/results.json, results.md and the PNGs in {results['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
