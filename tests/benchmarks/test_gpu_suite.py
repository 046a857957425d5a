"""benchmarks/gpu_suite.py: --tiny runs every section on the CPU and writes its files; a failing
section is reported and the suite goes on; the pytest section reports failing GPU tests."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_suite", BENCHMARKS / "gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_suite"] = module
    spec.loader.exec_module(module)
    return module


suite = _load()


def _check_reported(sections):
    assert list(sections) == list(suite.SECTIONS)
    for name, entry in sections.items():
        assert entry["status"] in ("ran", "skipped", "failed"), name
        assert {"ran": "seconds", "skipped": "reason", "failed": "error"}[entry["status"]] in entry, name


@pytest.mark.slow
def test_tiny_suite_runs_every_section_and_writes_its_files(tmp_path):
    assert suite.main(["--tiny", "--skip-pytest", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    sections = results["sections"]
    _check_reported(sections)
    assert sections["pytest"]["status"] == "skipped" and "--skip-pytest" in sections["pytest"]["reason"]
    assert results["skipped"] == {"pytest": sections["pytest"]["reason"]} and results["failed"] == {}
    assert results["device"] == "cpu" and results["torch"] and results["device_name"]
    parity = {row["method"]: row for row in sections["attention_parity"]["rows"]}
    assert set(parity) == {"plain torch bf16", *suite.BACKENDS}
    assert parity["math"]["met"] and parity["math"]["worst_ratio"] <= suite.PARITY_TARGET
    assert "skipped" in parity["varlen"]  # FlashAttention-2 needs CUDA: refused by the selector, with the reason
    cp = sections["cp_simulated"]["rows"]
    assert [row["cp_size"] for row in cp] == [2, 4, 8] and all(row["met"] and row["kernel"] == "math" for row in cp)
    placed = sections["cp_placement"]
    assert placed["backend"] == "math" and placed["ring_tiles"] == "math" and "communication" in placed["not_timed"]
    rows = placed["rows"]
    modes = suite.cp_rank_timing.MODES
    assert [(row["cp_size"], row["mode"]) for row in rows] == [(cp, mode) for cp in (2, 4) for mode in modes]
    te = {row["cp_size"]: row["busiest_rank_ms"] for row in rows if row["mode"] == "te"}
    for row in rows:
        assert row["packs"] > 0 and 0 < row["mean_rank_ms"] <= row["busiest_rank_ms"], row
        assert row["vs_te"] == row["busiest_rank_ms"] / te[row["cp_size"]], row
    a2a = [row for row in rows if row["mode"].startswith("a2a")]
    assert all(row["busiest_rank_ms"] == row["mean_rank_ms"] for row in a2a)  # the same work on every rank
    calibrated = sections["calibrate"]
    assert calibrated["backend"] == "math" and 0 < calibrated["host_op_us"] < 1e3
    assert suite.load_profile(tmp_path / "profile.json").host.asynchronous is False
    check = sections["model_check"]
    assert check["profile_source"] == "calibrated here"
    assert [(r["cp_size"], r["mode"]) for r in check["rows"]] == [(cp, mode) for cp in (2, 4) for mode in modes]
    for row in check["rows"]:
        assert row["modelled_ms"] > 0 and row["measured_ms"] > 0, row
        assert row["error"] == row["modelled_ms"] / row["measured_ms"] - 1, row
    stages = [row["stage"] for row in sections["thd_timings"]["rows"]]
    assert (
        stages[0] == "thd_collate (2 packs x 1024, one thread)"
        and stages[2].startswith("cp.shard")
        and stages[3].startswith("partition_indices")
    )
    runs = sections["throughput"]["result"]["runs"]
    assert runs and all(set(run["modes"]) == set(suite.train_throughput.MODES) for run in runs)
    text = (tmp_path / "results.md").read_text()
    headings = ("# GPU suite on", "## attention_parity", "## cp_simulated", "## cp_placement", "## model_check",
                "## thd_timings")  # fmt: skip
    for heading in (*headings, "## throughput"):
        assert heading in text
    assert "| pytest | skipped |" in text and "c/a (target >= 2.5)" in text
    assert "| busiest-rank ms | mean-rank ms | busiest vs te |" in text and "Not timed: communication" in text
    for png in ("attention_parity.png", "throughput.png"):
        assert (tmp_path / png).stat().st_size > 0


def test_a_failing_section_is_reported_and_the_suite_goes_on(tmp_path, monkeypatch):
    def broken(device, tiny):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (planted)")

    def unavailable(*args):
        raise suite.Skipped("planted: not here")

    monkeypatch.setattr(suite, "attention_parity", broken)
    monkeypatch.setattr(suite, "cp_simulated", unavailable)
    monkeypatch.setattr(suite, "cp_placement", unavailable)
    monkeypatch.setattr(suite, "throughput", unavailable)
    assert suite.main(["--tiny", "--skip-pytest", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    _check_reported(results["sections"])
    parity = results["sections"]["attention_parity"]
    assert parity["status"] == "failed" and "illegal memory access" in parity["error"]
    assert "RuntimeError" in parity["traceback"]
    assert results["sections"]["thd_timings"]["status"] == "ran"
    skipped = results["skipped"]
    assert skipped["cp_simulated"] == skipped["cp_placement"] == skipped["throughput"] == "planted: not here"
    assert skipped["model_check"] == "cp_placement did not run: nothing measured to check against"
    assert results["failed"] == {"attention_parity": parity["error"]}
    text = (tmp_path / "results.md").read_text()
    assert "| attention_parity | failed |" in text and "## attention_parity failed" in text
    assert results["parity_plot"] == "no parity plot: no backend ran"


@pytest.mark.parametrize(("returncode", "status"), [(0, "ran"), (5, "ran"), (1, "failed")])
def test_the_pytest_section_reports_the_gpu_tests_summary(monkeypatch, returncode, status):
    calls = []
    summary = {0: "2 passed, 1 skipped in 3.0s", 5: "no tests ran in 0.1s", 1: "1 failed, 2 passed in 3.0s"}[returncode]

    def fake_run(command, **kwargs):
        calls.append((command, kwargs))
        return subprocess.CompletedProcess(command, returncode, stdout=f"..s\n\n{summary}\n", stderr="")

    monkeypatch.setattr(suite.subprocess, "run", fake_run)
    entry = suite.run_section("pytest", lambda: suite.gpu_tests(60), say=lambda line: None)
    assert entry["status"] == status
    command, kwargs = calls[0]
    assert command[1:6] == ["-m", "pytest", "-m", "gpu", "-q"] and kwargs["timeout"] == 60
    assert str(suite.ROOT) in kwargs["env"]["PYTHONPATH"].split(":")
    if status == "ran":
        assert entry["summary"] == summary and entry["returncode"] == returncode
    else:
        assert entry["error"].startswith("RuntimeError: pytest exited with 1: 1 failed, 2 passed in 3.0s")


def test_a_hung_pytest_is_a_failed_section(monkeypatch):
    def hang(command, **kwargs):
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(suite.subprocess, "run", hang)
    entry = suite.run_section("pytest", lambda: suite.gpu_tests(5), say=lambda line: None)
    assert entry["status"] == "failed" and entry["error"] == "RuntimeError: pytest ran past --pytest-timeout=5 s"
