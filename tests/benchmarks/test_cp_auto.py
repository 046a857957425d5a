"""benchmarks/cp_auto.py --tiny: auto is never slower than te / adaptive / a2a per epoch on its data
sets, and never on any pack against that pack's other layouts; benchmarks/mesh_vs_fixed.py --tiny runs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
spec = importlib.util.spec_from_file_location("cp_auto", BENCHMARKS / "cp_auto.py")
cp_auto = importlib.util.module_from_spec(spec)
sys.modules["cp_auto"] = cp_auto
spec.loader.exec_module(cp_auto)


def test_tiny_run(tmp_path):
    out = tmp_path / "auto.json"
    assert cp_auto.main(["--tiny", "--cp-sizes", "2", "8", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["cp_size"] for r in rows} == {2, 8} and len(rows) >= 4
    for r in rows:
        assert r["auto"]["violations"] == 0
        others = min(r[m]["seconds"] for m in ("te", "adaptive", "a2a") if m in r)
        assert r["auto"]["seconds"] <= r["adaptive"]["seconds"]
        assert r["auto"]["seconds"] <= others * 1.01  # te's / a2a's own packs differ: within 1% on these
        assert sum(r["auto"]["chosen"].values()) == r["auto"]["packs"]


def test_mesh_vs_fixed_tiny_run(tmp_path):
    spec = importlib.util.spec_from_file_location("mesh_vs_fixed", BENCHMARKS / "mesh_vs_fixed.py")
    mesh_vs_fixed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mesh_vs_fixed)
    out = tmp_path / "mesh.json"
    assert mesh_vs_fixed.main(["--tiny", "--gpus", "16", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["mesh"]["mode"] == "mesh" and r["best_fixed"]["mode"] != "mesh" for r in rows)
    assert all(r["mesh_vs_best_fixed"] > 0 for r in rows)
