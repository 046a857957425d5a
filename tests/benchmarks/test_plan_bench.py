"""benchmarks/plan_bench.py: --tiny runs every section (the real data and the peers when
../shared has them) and writes its JSON; the before/after rows are consistent."""

from __future__ import annotations

import json

import pytest

from support.benchmarks import load_benchmark


@pytest.mark.slow
def test_tiny_mode_runs(tmp_path, capsys, shared_data_if_any):
    bench = load_benchmark("plan_bench")
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
