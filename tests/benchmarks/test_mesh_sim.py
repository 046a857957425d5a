"""benchmarks/mesh_sim.py: the --tiny sweep and the --megatron check run, and their numbers hang together."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "mesh_sim.py"
spec = importlib.util.spec_from_file_location("mesh_sim", SCRIPT)
mesh_sim = importlib.util.module_from_spec(spec)
sys.modules["mesh_sim"] = mesh_sim
spec.loader.exec_module(mesh_sim)


def test_tiny_sweep_runs_every_mode(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert mesh_sim.main(["--tiny", "--json", str(out), "--plot", str(tmp_path / "sim.png")]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["gpus"], r["mode"]) for r in rows} == {(g, m) for g in (8, 16) for m in mesh_sim.MODES}
    for r in rows:
        parts = sum(r[f"{p}_ms"] for p in mesh_sim.PARTS)
        assert abs(parts - r["step_ms"]) <= 1e-6 * r["step_ms"] and r["tokens_per_s_per_gpu"] > 0
    assert "| GPUs | mode | cp |" in capsys.readouterr().out


def test_megatron_check_reports_published_modelled_and_thdpack(tmp_path, capsys):
    out = tmp_path / "megatron.json"
    assert mesh_sim.main(["--megatron", "--tiny", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "195.3 /" in text and "151.9 /" in text  # the published 4-GPU step times
    assert "Which profile the published times support" in text and "thdpack's modes on the same workload" in text
    check = json.loads(out.read_text())["megatron"]
    for name in ("h100_sxm", "gb200_nvl72"):
        rows = check["profiles"][name]
        assert [r["gpus"] for r in rows] == [4, 8, 16, 32, 64]
        for r in rows:
            assert r["speedup"] > 0 and r["dp_balanced"]["step_ms"] > 0
    assert set(check["thdpack"]["4"]) == set(mesh_sim.MODES)
