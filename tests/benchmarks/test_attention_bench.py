"""benchmarks/attention_bench.py: --tiny runs on the CPU, and a failing backend is reported in its row
while the others still run."""

from __future__ import annotations

from support.benchmarks import load_benchmark


def test_a_failing_backend_is_reported_and_the_run_goes_on(monkeypatch, capsys, tmp_path):
    bench = load_benchmark("attention_bench")
    real = bench.thd_attention

    def flaky(q, k, v, thd, *, backend, **kwargs):
        if backend == "sdpa":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(q, k, v, thd, backend=backend, **kwargs)

    monkeypatch.setattr(bench, "thd_attention", flaky)
    bench.main(["--tiny", "--backends", "sdpa", "math", "varlen", "--json", str(tmp_path / "out.json")])
    lines = capsys.readouterr().out.splitlines()
    sdpa = next(line for line in lines if " sdpa " in line)
    math = next(line for line in lines if " math " in line)
    varlen = next(line for line in lines if " varlen " in line)
    assert "failed: RuntimeError: CUDA error" in sdpa
    assert "skipped:" in varlen  # refused by the selector on the CPU: a skip, not a failure
    assert "failed" not in math and "skipped" not in math
