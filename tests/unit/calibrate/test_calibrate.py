"""`thdpack calibrate` in one process: a valid profile whose measured numbers cite this machine and
whose unmeasured ones cite the base profile; the links need several ranks; clean errors."""

from __future__ import annotations

import json

import pytest
import torch

from thdpack.calibrate.kernels import HOST_CHAIN, attention_curves, host_op_seconds
from thdpack.cli import main
from thdpack.perf.machine import load_profile
from thdpack.perf.shape import ModelShape

SHAPE = ModelShape(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=16, vocab=256)


def test_one_process_writes_a_profile_of_this_machine(tmp_path, capsys):
    (tmp_path / "model.json").write_text(json.dumps({k: getattr(SHAPE, k) for k in ("layers", "hidden", "ffn",
                                                                                     "heads", "kv_heads",
                                                                                     "head_dim", "vocab")}))  # fmt: skip
    out = tmp_path / "machine.json"
    argv = ["calibrate", "--model", str(tmp_path / "model.json"), "--out", str(out), "--rank-tokens", "256",
            "--budget-s", "5", "--repeats", "1"]  # fmt: skip
    assert main(argv) == 0
    assert f"wrote {out} (calibrated_cpu)" in capsys.readouterr().out
    profile = load_profile(out)
    assert profile.host.asynchronous is False and 0 < profile.host.op_s < 1e-3
    assert profile.matmul_efficiency == 1.0 and profile.peak_flops > 1e8
    assert profile.attention.tile == 16 and profile.attention.forward_causal[0][0] == 16
    assert profile.gpus_per_node == profile.nvlink_domain == 1
    cited = {key: s.source for s in profile.sources for key in s.keys}
    for key in ("peak_flops", "attention.backward", "host.op_s", "memory_bandwidth"):
        assert cited[key].startswith("measured by thdpack calibrate on ") and "math backend" in cited[key]
    assert cited["intra_node.bandwidth"].startswith("from profile cpu_gloo: placeholder")  # one process: no link


def test_attention_curves_stop_at_the_deadline_after_two_lengths():
    curves = attention_curves(SHAPE, backend="math", device=torch.device("cpu"), dtype=torch.float32,
                              lengths=[16, 32, 64, 128], tokens=128, repeats=1, deadline=0.0)  # fmt: skip
    assert [n for n, _ in curves.forward_causal] == [16, 32]
    assert all(rate > 0 for _, rate in curves.backward) and curves.call_overhead_s > 0


def test_host_op_is_microseconds():
    seconds = host_op_seconds(device=torch.device("cpu"), repeats=1)
    assert 1e-7 < seconds < 1e-3 and HOST_CHAIN >= 100


def test_a_model_without_a_source_is_refused(tmp_path, capsys):
    argv = ["calibrate", "--model", "gpt-9", "--out", str(tmp_path / "m.json")]
    assert main(argv) == 2
    assert "unknown model 'gpt-9'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--repeats", "0", "--repeats must be >= 1, got 0"),
        ("--budget-s", "0", "--budget-s must be a finite number of seconds > 0, got 0.0"),
        ("--budget-s", "-5", "--budget-s must be a finite number of seconds > 0, got -5.0"),
        ("--budget-s", "nan", "--budget-s must be a finite number of seconds > 0, got nan"),
        ("--rank-tokens", "0", "--rank-tokens must be >= 1, got 0"),
        ("--rank-tokens", "8", "--rank-tokens=8 is too few to time a kernel on; use at least 16"),
    ],
)
def test_an_effort_that_cannot_time_anything_is_named_before_measuring(tmp_path, capsys, option, value, message):
    out = tmp_path / "p.json"
    assert main(["calibrate", "--model", "tiny", "--out", str(out), option, value]) == 2
    assert f"thdpack calibrate: error: {message}" in capsys.readouterr().err
    assert not out.exists()
