"""benchmarks/plan_bench.py: --tiny runs every section (the real data and the peers when
../shared has them) and writes its JSON; the before/after rows are consistent."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_bench.py"


def _load():
    spec = importlib.util.spec_from_file_location("plan_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["plan_bench"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_tiny_mode_runs(tmp_path, capsys, shared_data_if_any):
    bench = _load()
    shared = (
        shared_data_if_any.parent if shared_data_if_any.is_dir() else tmp_path / "no-shared"
    )  # ../shared: data, peers
    out = tmp_path / "plan.json"
    assert bench.main(["--tiny", "--shared", str(shared), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "### The improvement phase" in text and "### Targets" in text
    results = json.loads(out.read_text())
    rows = results["improve"]
    dists = {r["dist"] for r in rows}
    assert {"uniform", "web"} <= dists
    if (shared / "data" / "alpaca_data.json").exists():
        assert {"alpaca raw", "alpaca templated", "stdlib"} <= dists
    for r in rows:
        assert r["more_than_fit"] == 0  # never more packs than bfd
        assert r["over_l2_mean"] <= r["fit_over_l2_mean"]
        assert 0 <= r["optimal"] <= r["instances"]
    assert results["histogram"]["packs"] <= results["histogram"]["fit_packs"]
    if (shared / "peers" / "bench_packing.py").exists():
        packers = {r["packer"] for r in results["peers"]}
        assert {"thdpack bfd", "thdpack bfd+improve", "sequential_next_fit"} <= packers
