"""benchmarks/cp_model_check.py: each mode's run is the packs cp_throughput.py trains, laid out as
that mode lays them out, and the check compares the modelled ratio to te with the measured one."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from thdpack.perf.mesh import COMMS

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


check = _load("cp_model_check")
cpt = sys.modules["cp_throughput"]


def test_mode_runs_are_the_timed_steps_packs_in_each_layout():
    cfg = replace(cpt.TINY, pack_size=64, packs_per_step=2, warmup=1, steps=2)
    pieces = np.array([5, 60, 3, 17, 9, 30, 1, 12, 20, 3, 40, 7], dtype=np.int64)
    runs = check.mode_runs(cfg, pieces)
    planned = cpt.step_plan(pieces, cfg, cfg.warmup + cfg.steps)
    timed = planned.lengths_E[planned.offsets[cfg.warmup * cfg.packs_per_step] :]
    for mode, run in runs.items():
        assert (run.steps, run.rounds, run.world) == (2, 2, 2), mode
        assert sorted(run.entry_length.tolist()) == sorted(timed.tolist()), mode  # the warm-up step left out
        assert (run.tokens == 32).all(), mode  # every rank holds L / cp
    comms = {mode: {COMMS[c] for c in run.group_comm} for mode, run in runs.items()}
    assert comms["te"] == {"ring"} and comms["a2a"] == {"a2a"} and "whole" in comms["adaptive"]


def test_the_check_compares_modelled_and_measured_ratios(tmp_path):
    cfg = cpt.TINY
    config = {**asdict(cfg), "model": asdict(cfg.model)}
    measured = [{"config": config, "rows": [
        {"data": "python311_stdlib", "mode": mode, "step_s_median": step, "step_s": [step], "vs_te": 2.0 / step}
        for mode, step in (("te", 2.0), ("adaptive", 1.6), ("a2a", 2.5))
    ]}]  # fmt: skip
    (tmp_path / "measured.json").write_text(json.dumps(measured))
    out = tmp_path / "check.json"
    argv = ["--profile", "cpu_gloo", "--measured", str(tmp_path / "measured.json"), "--json", str(out)]
    assert check.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["te", "adaptive", "a2a"] and rows[0]["predicted_vs_te"] == 1.0
    for r in rows:
        assert r["error"] == r["predicted_vs_te"] / r["measured_vs_te"] - 1
        assert abs(sum(r["parts_s"].values()) - r["predicted_step_s"]) < 1e-9 * r["predicted_step_s"]
