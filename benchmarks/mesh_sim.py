"""Modelled step time on a dp x cp mesh, per CP mode, from a lengths file (thdpack.perf's step model).

    python benchmarks/mesh_sim.py                                   # Alpaca on H100, 8 .. 1,024 GPUs
    python benchmarks/mesh_sim.py --lengths my.npy --model llama3-8b --profile gb200_nvl72 --gpus 64 1024 \\
        --cp 8 --rank-tokens 8192 --json out.json --plot out.png
    python benchmarks/mesh_sim.py --lognormal 1000000 --plot docs/performance/mesh_sim.png   # Megatron's mix
    python benchmarks/mesh_sim.py --tiny                            # seconds on the CPU (the test)
    python benchmarks/mesh_sim.py --megatron                        # Megatron-LM's dynamic-CP table, checked
    python benchmarks/mesh_sim.py --timing                          # 1M sequences at 1,024 GPUs: seconds per mode

For every GPU count and mode (``thdpack.perf.modes``: ``te``, ``adaptive``, ``a2a``, ``auto``, ``mesh``) the
lengths are planned as thdpack's trainer plans them (one epoch, packs of ``cp x rank_tokens``
tokens, ``dp x micro_batches`` packs per step dealt to the data-parallel ranks), and the step
model (``thdpack.perf.step``) gives each step's time and its breakdown: linear, attention, exposed
communication, waiting (at the barrier and in groups), the data-parallel gradient all-reduce and
the optimizer. Nothing runs on a GPU: this is the model, from the profile's public constants.

``--megatron`` draws Megatron-LM's mock workload (``examples/dynamic_context_parallel``: lognormal
lengths, min 128, max 8192, mean 1024, sigma 1.5; ``thdpack.perf.megatron.lognormal_lengths`` says
how mean and sigma are read), models Megatron's two schedulers on the H100 and GB200 profiles at
4 .. 64 GPUs (4 per node, CP 4, 8 micro-batches of one sample per data-parallel rank, 2048 tokens
per rank, the 12-layer 2048-hidden GPT), prints predicted against published step times and
speedups, what the published table implies about the profile and about what the model leaves
out, then thdpack's modes on the same workload (planned over the epoch, in milliseconds per
global batch of ``8 x dp`` samples).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from thdpack.data.stats_command import example_lengths_path, load_lengths
from thdpack.perf.comm import Topology
from thdpack.perf.machine import PROFILE_NAMES, load_profile
from thdpack.perf.megatron import MEGATRON_SPEC, SCHEDULERS, lognormal_lengths, scheduler_run
from thdpack.perf.mesh import COMMS, MeshRun
from thdpack.perf.modes import MODES, mode_run
from thdpack.perf.shape import NAMED_SHAPES, ModelShape, load_shape
from thdpack.perf.step import PARTS, StepModel, TrainingSpec

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("THDPACK_SHARED_DATA", ROOT.parent / "shared" / "data"))
ALPACA = SHARED / "alpaca_data.gpt2.lengths.npy"
TINY_SEQUENCES = 3000

# Megatron-LM examples/dynamic_context_parallel/README.md (June 9, 2026): 10%-trimmed mean step ms
PUBLISHED = {4: (195.269, 151.906), 8: (220.119, 155.850), 16: (226.775, 187.125), 32: (286.206, 208.088),
             64: (271.988, 181.912)}  # fmt: skip
MEGATRON_GPUS = (4, 8, 16, 32, 64)
MEGATRON_CP, MEGATRON_MICRO_BATCHES, MEGATRON_RANK_TOKENS, MEGATRON_GPUS_PER_NODE = 4, 8, 2048, 4
MEGATRON_STEPS = 200


def read_lengths(path: Path | None, tiny: bool) -> tuple[str, np.ndarray]:
    """(name, lengths >= 1) of a lengths file (``thdpack stats``' formats), or of the shared Alpaca
    lengths (the stdlib example shipped with thdpack when they are absent)."""
    if path is None:
        path = ALPACA if ALPACA.exists() else example_lengths_path()
    lengths = load_lengths(path)
    lengths = lengths[lengths > 0]  # lengths files count records that tokenized to nothing
    return path.name, lengths[:TINY_SEQUENCES] if tiny else lengths


def simulate(
    lengths: np.ndarray,
    *,
    model: StepModel,
    gpus: list[int],
    cp: int,
    rank_tokens: int,
    micro_batches: int,
    modes: tuple[str, ...] = MODES,
) -> list[dict[str, object]]:
    """One row per GPU count and mode: mean step ms, its breakdown, tokens/s per GPU, seconds taken."""
    rows = []
    for world in gpus:
        for mode in modes:
            tick = time.perf_counter()
            run = mode_run(lengths, mode, world=world, cp=cp, rank_tokens=rank_tokens, micro_batches=micro_batches,
                           model=model)  # fmt: skip
            times = model.run(run)
            tokens = float(run.entry_length.sum())
            rows.append({
                "gpus": world, "mode": mode, "cp": world if mode == "mesh" else cp, "steps": run.steps,
                **times.summary(),
                "tokens_per_s_per_gpu": tokens / float(times.step.sum()) / world,
                "seconds": time.perf_counter() - tick,
            })  # fmt: skip
    return rows


def table(rows: list[dict[str, object]]) -> str:
    head = "| GPUs | mode | cp | steps | step ms | " + " | ".join(f"{p} ms" for p in PARTS) + " | tokens/s/GPU |"
    lines = [head, "|" + "---|" * (6 + len(PARTS))]
    for r in rows:
        parts = " | ".join(f"{r[f'{p}_ms']:.2f}" for p in PARTS)
        lines.append(
            f"| {r['gpus']} | {r['mode']} | {r['cp']} | {r['steps']} | {r['step_ms']:.2f} | {parts} | "
            f"{r['tokens_per_s_per_gpu']:,.0f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, object]], path: Path, title: str) -> str:
    """Step time against GPU count, one line per mode (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        return f"no plot: matplotlib is not installed ({err})"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        ax.plot([r["gpus"] for r in mine], [r["step_ms"] for r in mine], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("modelled step time (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


# -- Megatron-LM's table ----------------------------------------------------------------------


def megatron_check(steps: int = MEGATRON_STEPS, gpus: tuple[int, ...] = MEGATRON_GPUS) -> dict[str, object]:
    """Megatron's two schedulers on the H100 and GB200 profiles against the published table, and
    thdpack's modes on the same workload (GB200)."""
    shape = NAMED_SHAPES["megatron-dcp-gpt"]
    spec = MEGATRON_SPEC
    out: dict[str, object] = {"steps": steps, "profiles": {}, "thdpack": {}}
    for name in ("h100_sxm", "gb200_nvl72"):
        profile = load_profile(name)
        model = StepModel(profile, shape, Topology.of(profile, MEGATRON_GPUS_PER_NODE), spec)
        rows = []
        for world in gpus:
            dp = world // MEGATRON_CP
            lengths = lognormal_lengths(MEGATRON_MICRO_BATCHES * dp * steps, seed=world)
            row: dict[str, object] = {"gpus": world}
            for scheduler in SCHEDULERS:
                run = scheduler_run(scheduler, lengths, dp=dp, cp=MEGATRON_CP, micro_batches=MEGATRON_MICRO_BATCHES,
                                    max_seqlen_per_rank=MEGATRON_RANK_TOKENS)  # fmt: skip
                times = model.run(run)
                row[scheduler] = times.summary()
                row[f"{scheduler}_ring_steps"] = _ring_steps_per_rank(run, shape) / steps
            row["speedup"] = row["dp_balanced"]["step_ms"] / row["dynamic_cp"]["step_ms"]
            rows.append(row)
        out["profiles"][name] = rows
    profile = load_profile("gb200_nvl72")
    model = StepModel(profile, shape, Topology.of(profile, MEGATRON_GPUS_PER_NODE), spec)
    for world in gpus:
        dp = world // MEGATRON_CP
        sequences = lognormal_lengths(MEGATRON_MICRO_BATCHES * dp * steps, seed=world) - 1  # inputs after the shift
        row = {}
        for mode in MODES:
            run = mode_run(sequences, mode, world=world, cp=MEGATRON_CP, rank_tokens=MEGATRON_RANK_TOKENS, model=model)
            times = model.run(run)
            per_batch = MEGATRON_MICRO_BATCHES * dp / len(run.entry_length)  # global batches per sequence run
            row[mode] = {k: v * times.step.size * per_batch for k, v in times.summary().items()}
        out["thdpack"][world] = row
    return out


def _ring_steps_per_rank(run: MeshRun, shape: ModelShape) -> float:
    """Ring steps of the mean rank over the run (a rank of a group of ``g`` runs ``g`` steps forward
    and ``g`` backward in every layer)."""
    ring = run.group_comm == COMMS.index("ring")
    worked = np.bincount(run.entry_group, minlength=len(run.group_size)) > 0
    return float(2 * shape.layers * (run.group_size[ring & worked] ** 2).sum()) / run.world


def megatron_report(check: dict[str, object]) -> str:
    lines = ["Megatron-LM dynamic-CP table (examples/dynamic_context_parallel/README.md), modelled vs published", ""]
    head = "| GPUs | profile | dp_balanced ms | dynamic CP ms | speedup |  (each: published / modelled / error)"
    lines += [head, "|---|---|---|---|---|"]
    verdicts = {}
    for name, rows in check["profiles"].items():
        ok_speed = ok_time = 0
        for row in rows:
            world = row["gpus"]
            pb, pd = PUBLISHED[world]
            mb, md = row["dp_balanced"]["step_ms"], row["dynamic_cp"]["step_ms"]
            eb, ed, es = mb / pb - 1, md / pd - 1, row["speedup"] / (pb / pd) - 1
            ok_speed += abs(es) <= 0.15
            ok_time += (abs(eb) <= 0.30) + (abs(ed) <= 0.30)
            lines.append(
                f"| {world} | {name} | {pb:.1f} / {mb:.1f} / {100 * eb:+.0f}% | "
                f"{pd:.1f} / {md:.1f} / {100 * ed:+.0f}% | {pb / pd:.3f} / {row['speedup']:.3f} / {100 * es:+.1f}% |"
            )
        verdicts[name] = (ok_speed, ok_time, len(rows))
    lines.append("")
    for name, (ok_speed, ok_time, n) in verdicts.items():
        lines.append(f"{name}: speedups within +-15%: {ok_speed}/{n}; step times within +-30%: {ok_time}/{2 * n}")
    lines += ["", "Which profile the published times support (the step from 4 GPUs, one node, to 8, two nodes):"]
    p4, p8 = PUBLISHED[4], PUBLISHED[8]
    for name, rows in check["profiles"].items():
        r4, r8 = rows[0], rows[1]
        rises = [r8[s]["step_ms"] - r4[s]["step_ms"] for s in SCHEDULERS]
        dp_rise = r8["dynamic_cp"]["dp_ms"] - r4["dynamic_cp"]["dp_ms"]
        lines.append(
            f"  {name}: modelled rise dp_balanced {rises[0]:+.1f} ms, dynamic CP {rises[1]:+.1f} ms "
            f"(gradient all-reduce {dp_rise:+.1f} ms); published {p8[0] - p4[0]:+.1f} / {p8[1] - p4[1]:+.1f} ms"
        )
    gb200 = load_profile("gb200_nvl72")
    te = MEGATRON_SPEC.host
    step_ops = (te.ring_step.total + 2 * te.exchange) / 2  # one ring step, forward or backward
    lines += [
        "",
        "What the published table implies beyond the model (GB200; diagnosis only, nothing is fitted). The model "
        f"charges {1e6 * step_ops * gb200.host.op_s:.0f} us of host time per ring step and direction (TE's p2p: "
        f"{step_ops:.1f} eager ops at {1e6 * gb200.host.op_s:.2f} us):",
    ]
    for row in check["profiles"]["gb200_nvl72"]:
        world = row["gpus"]
        pb, pd = PUBLISHED[world]
        mb, md = row["dp_balanced"]["step_ms"], row["dynamic_cp"]["step_ms"]
        extra_ring = row["dp_balanced_ring_steps"] - row["dynamic_cp_ring_steps"]
        per_step = ((pb - pd) - (mb - md)) / extra_ring * 1e3 if extra_ring else float("nan")
        lines.append(
            f"  {world} GPUs: outside the model {pd - md:.0f} ms of dynamic CP's step ({100 * (1 - md / pd):.0f}%); "
            f"the baseline's extra cost {pb - pd:.0f} ms published vs {mb - md:.1f} ms modelled over "
            f"{extra_ring:.0f} more ring steps per rank ({per_step:+.0f} us per ring step unexplained)"
        )
    lines += [
        "",
        "thdpack's modes on the same workload (GB200, planned over the epoch; ms per global batch of 8 x dp):",
    ]
    lines += [
        "| GPUs | Megatron dynamic CP | " + " | ".join(MODES) + " | best vs dynamic CP |",
        "|---" * (3 + len(MODES)) + "|",
    ]
    for row, mine in zip(check["profiles"]["gb200_nvl72"], check["thdpack"].values(), strict=True):
        dcp = row["dynamic_cp"]["step_ms"]
        best = min(mine[m]["step_ms"] for m in MODES)
        cells = " | ".join(f"{mine[m]['step_ms']:.1f}" for m in MODES)
        lines.append(f"| {row['gpus']} | {dcp:.1f} | {cells} | {dcp / best:.2f}x |")
    return "\n".join(lines)


# -- timing -----------------------------------------------------------------------------------


def timing(lengths: np.ndarray, model: StepModel, world: int, cp: int, rank_tokens: int) -> list[dict[str, object]]:
    """Seconds to plan and model every mode on ``world`` GPUs (one step per pack round)."""
    rows = []
    for mode in MODES:
        tick = time.perf_counter()
        run = mode_run(lengths, mode, world=world, cp=cp, rank_tokens=rank_tokens, model=model)
        planned = time.perf_counter()
        model.run(run)
        done = time.perf_counter()
        rows.append({"mode": mode, "plan_s": planned - tick, "model_s": done - planned, "total_s": done - tick})
        print(f"{mode}: plan + deal {planned - tick:.1f} s, model {done - planned:.1f} s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=Path, default=None, help="a .npy, text file or token store of lengths")
    parser.add_argument("--lognormal", type=int, default=None, metavar="N",
                        help="N lengths of Megatron-LM's mock distribution instead of a file")  # fmt: skip
    parser.add_argument("--model", default="llama3-8b", help=f"a config.json, or one of {', '.join(NAMED_SHAPES)}")
    parser.add_argument("--profile", default="h100_sxm", help=f"a profile JSON or one of {', '.join(PROFILE_NAMES)}")
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: the profile's")
    parser.add_argument("--cp", type=int, default=8, help="CP group of te / adaptive / a2a (mesh: all GPUs)")
    parser.add_argument("--rank-tokens", type=int, default=8192, help="tokens per rank: packs of cp x this")
    parser.add_argument("--micro-batches", type=int, default=8, help="packs per data-parallel rank per step")
    parser.add_argument("--overlap-dp", action=argparse.BooleanOptionalAction, default=True,
                        help="the gradient all-reduce overlaps the last backward (thdpack's trainer: yes)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true",
                        help=f"the first {TINY_SEQUENCES:,} lengths, 8 and 16 GPUs, one micro-batch")  # fmt: skip
    parser.add_argument("--megatron", action="store_true", help="check the model against Megatron-LM's table")
    parser.add_argument("--timing", type=int, nargs="?", const=1_000_000, default=None,
                        help="seconds for N (1M) lognormal lengths at the largest --gpus")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    record: dict[str, object] = {"machine": platform.platform()}
    if args.megatron:
        check = megatron_check(steps=20 if args.tiny else MEGATRON_STEPS)
        print(megatron_report(check))
        record["megatron"] = check
    else:
        profile = load_profile(args.profile)
        model = StepModel(profile, load_shape(args.model), Topology.of(profile, args.gpus_per_node),
                          TrainingSpec(overlap_dp=args.overlap_dp))  # fmt: skip
        if args.timing:
            lengths = lognormal_lengths(args.timing, seed=0)
            world = max(args.gpus)
            print(f"{args.timing:,} sequences, {world} GPUs, cp {args.cp}, {args.rank_tokens} tokens per rank")
            tick = time.perf_counter()
            record["timing"] = timing(lengths, model, world, args.cp, args.rank_tokens)
            print(f"all modes: {time.perf_counter() - tick:.1f} s")
        else:
            if args.lognormal:
                name, lengths = f"lognormal x {args.lognormal:,}", lognormal_lengths(args.lognormal, seed=0)
            else:
                name, lengths = read_lengths(args.lengths, args.tiny)
            gpus = [8, 16] if args.tiny else args.gpus
            micro_batches = 1 if args.tiny else args.micro_batches
            rows = simulate(lengths, model=model, gpus=gpus, cp=args.cp, rank_tokens=args.rank_tokens,
                            micro_batches=micro_batches)  # fmt: skip
            print(f"{name}: {len(lengths):,} sequences, model {args.model}, profile {profile.name}")
            print(table(rows))
            record["rows"] = rows
            if args.plot:
                print(plot(rows, args.plot, f"{name}, {args.model}, {profile.name}"))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1, default=float))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
