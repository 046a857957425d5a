"""The step model against measured CPU steps: ``cp_throughput.py``'s te / adaptive / a2a, predicted.

    python benchmarks/cp_model_check.py --calibrate docs/performance/calibrated_cpu.json  # 2 gloo ranks, < 1 min
    python benchmarks/cp_model_check.py --profile docs/performance/calibrated_cpu.json \\
        --measured docs/performance/cp_throughput_cpu_rerun.json docs/performance/cp_throughput_cpu.json \\
        --json docs/performance/cp_model_check_cpu.json

``--calibrate`` runs ``thdpack calibrate`` under ``torchrun`` with ``cp`` gloo processes for the
model ``cp_throughput.py`` trains (fp32, ``L / cp`` tokens per rank) and writes the profile.
The check reads ``cp_throughput.json`` files (what ``python benchmarks/train_throughput.py --cp 2``
measured: per lengths file the config, each mode's median step and its ratio to ``te``), plans
the very packs that run trained (``cp_throughput.step_plan``: the same plan, order and
placement), builds each mode's mesh run (one CP group of ``cp`` ranks, ``packs_per_step``
rounds per step; ``adaptive`` on its placement, ``a2a`` all-to-all on ``te``'s packs) and models
its timed steps with the profile (``thdpack.perf.step``, thdpack's CPU stack ``THDPACK_CPU``:
host and device add on a CPU). The modelled ratio ``te / mode`` of the mean step is compared with
the measured ratio of medians; the target is +-15%.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

from cp_throughput import CpThroughputConfig, step_plan  # noqa: E402
from throughput_inputs import DATASETS, load_lengths, split_documents  # noqa: E402

from thdpack.attention.config import AttentionConfig  # noqa: E402
from thdpack.models import ModelConfig  # noqa: E402
from thdpack.perf.comm import Topology  # noqa: E402
from thdpack.perf.host import THDPACK_CPU  # noqa: E402
from thdpack.perf.machine import load_profile  # noqa: E402
from thdpack.perf.mesh import MeshRun, placed_run  # noqa: E402
from thdpack.perf.shape import ModelShape  # noqa: E402
from thdpack.perf.step import PARTS, StepModel, TrainingSpec  # noqa: E402

TARGET = 0.15
CPU_SPEC = TrainingSpec(grad_itemsize=4, optimizer_bytes_per_param=28.0, host=THDPACK_CPU)
"""How ``cp_throughput.py`` trains on the CPU: fp32 gradients all-reduced by DDP during the backward,
AdamW on fp32 parameters (read and written: parameter, gradient read, both moments: 28 bytes)."""


def cpu_shape(model: ModelConfig) -> ModelShape:
    """The decoder's shape in fp32, as the CPU runs it (4 bytes per activation sent)."""
    return dataclasses.replace(ModelShape.from_model_config(model), itemsize=4)


def config_of(result: dict[str, Any]) -> CpThroughputConfig:
    """The ``CpThroughputConfig`` a ``cp_throughput.json`` result ran."""
    config = dict(result["config"])
    model = dict(config.pop("model"))
    model["attention"] = AttentionConfig(**model["attention"])
    return CpThroughputConfig(model=ModelConfig(**model), **config)


def mode_runs(cfg: CpThroughputConfig, pieces_S: np.ndarray) -> dict[str, MeshRun]:
    """Each mode's mesh run of the timed steps of a ``cp_throughput.py`` run of ``cfg``."""
    planned = step_plan(pieces_S, cfg, cfg.warmup + cfg.steps)
    per_step, cp = cfg.packs_per_step, cfg.cp_size
    first = cfg.warmup * per_step
    packs = np.arange(first, len(planned.segments))
    a, b = planned.offsets[first], planned.offsets[-1]
    offsets = planned.offsets[first:] - a
    lengths = planned.lengths_E[a:b]
    te_size, zeros = np.full(len(lengths), cp), np.zeros(len(lengths), dtype=np.int64)
    layouts = {"te": (te_size, zeros, "ring"), "adaptive": (planned.size_E[a:b], planned.start_E[a:b], "ring"),
               "a2a": (te_size, zeros, "a2a")}  # fmt: skip
    runs = {}
    for mode, (size, start, comm) in layouts.items():
        runs[mode] = placed_run(
            offsets=offsets, lengths=lengths, group_size=size, group_start=start,
            pack_step=packs // per_step - cfg.warmup, pack_round=packs % per_step,
            pack_dp=np.zeros(len(packs), dtype=np.int64), cp_size=cp, dp_size=1, pack_size=cfg.pack_size,
            split_comm=comm,
        )  # fmt: skip
    return runs


def check(profile_path: Path, measured: list[dict[str, Any]], label: str = "") -> list[dict[str, Any]]:
    """One row per lengths file and mode of a ``cp_throughput.json`` (``label``: which run):
    measured and modelled step and ratio to ``te``."""
    profile = load_profile(profile_path)
    rows = []
    for result in measured:
        cfg = config_of(result)
        data = result["rows"][0]["data"]
        path = next(p for p in DATASETS.values() if p.name.split(".")[0] == data)
        pieces, _ = split_documents(load_lengths(path)[0], cfg.pack_size)
        model = StepModel(profile, cpu_shape(cfg.model), Topology.of(profile, cfg.cp_size), CPU_SPEC)
        times = {mode: model.run(run) for mode, run in mode_runs(cfg, pieces).items()}
        step = {mode: float(t.step.mean()) for mode, t in times.items()}
        for row in result["rows"]:
            mode = row["mode"]
            predicted = step["te"] / step[mode]
            rows.append({
                "run": label, "data": data, "mode": mode, "measured_step_s": row["step_s_median"],
                "measured_steps_s": row["step_s"],
                "predicted_step_s": step[mode], "measured_vs_te": row["vs_te"], "predicted_vs_te": predicted,
                "error": predicted / row["vs_te"] - 1,
                "parts_s": {p: float(times[mode].parts[p].mean()) for p in PARTS},
            })  # fmt: skip
    return rows


def markdown(rows: list[dict[str, Any]], profile: str) -> str:
    lines = [
        f"Profile {profile}; modelled with thdpack.perf (THDPACK_CPU), measured by cp_throughput.py; target: the "
        f"te / mode ratio within +-{100 * TARGET:.0f}%.",
        "",
        "| run | data | mode | measured step s (median; range) | modelled step s | measured te/mode |"
        " modelled te/mode | error | modelled linear / attention / comm / host s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        parts = " / ".join(f"{r['parts_s'][p]:.2f}" for p in ("linear", "attention", "comm", "host"))
        lines.append(
            f"| {r['run']} | {r['data']} | {r['mode']} | {r['measured_step_s']:.2f} ({min(r['measured_steps_s']):.1f}-"
            f"{max(r['measured_steps_s']):.1f}) | {r['predicted_step_s']:.2f} | "
            f"{r['measured_vs_te']:.3f} | {r['predicted_vs_te']:.3f} | {100 * r['error']:+.1f}% | {parts} |"
        )
    met = sum(abs(r["error"]) <= TARGET for r in rows)
    return "\n".join([*lines, "", f"ratios within +-{100 * TARGET:.0f}%: {met}/{len(rows)}"])


def calibrate(out: Path, cfg: CpThroughputConfig) -> None:
    """``thdpack calibrate`` under torchrun, ``cp`` gloo processes, for ``cfg``'s model in fp32."""
    with tempfile.TemporaryDirectory() as tmp:
        shape = Path(tmp) / "model.json"
        fields = dataclasses.asdict(cpu_shape(cfg.model))
        shape.write_text(json.dumps(fields))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg.cp_size}",
                   "-m", "thdpack.cli", "calibrate", "--model", str(shape), "--out", str(out),
                   "--rank-tokens", str(cfg.pack_size // cfg.cp_size), "--dtype", "float32"]  # fmt: skip
        subprocess.run(command, check=True, cwd=ROOT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibrate", type=Path, default=None, metavar="OUT", help="write a calibrated CPU profile")
    parser.add_argument("--profile", type=Path, default=None, help="the profile to model with")
    parser.add_argument("--measured", type=Path, nargs="+", default=None, help="cp_throughput.json files")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    if args.calibrate:
        calibrate(args.calibrate, CpThroughputConfig())
    if args.profile and args.measured:
        rows = [row for path in args.measured for row in check(args.profile, json.loads(path.read_text()), path.name)]
        print(markdown(rows, str(args.profile)))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"profile": str(args.profile), "measured": str(args.measured),
                                             "target": TARGET, "rows": rows}, indent=1) + "\n")  # fmt: skip
            print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
