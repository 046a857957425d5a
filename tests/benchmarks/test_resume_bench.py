"""benchmarks/resume_bench.py at a small size: every change plans a rest over what was not consumed."""

from __future__ import annotations

import json

from support.benchmarks import load_benchmark


def test_small_run_plans_every_rest(tmp_path, capsys):
    bench = load_benchmark("resume_bench")
    out = tmp_path / "resume.json"
    assert bench.main(["--sequences", "20000", "--repeats", "1", "--json", str(out)]) == 0
    assert "| cp 2 -> cp 1 |" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert [r["change"] for r in rows] == list(bench.CHANGES)
    for r in rows:
        assert r["consumed_sequences"] + r["rest_sequences"] - r["consumed_in_part"] == r["sequences"]
    assert rows[-1]["consumed_in_part"] > 0  # split sequences consumed in part
