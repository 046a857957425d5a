"""`thdpack plan --suggest`: every option timed, the fastest suggested, clean errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from thdpack.cli import main
from thdpack.perf.shape import NAMED_SHAPES
from thdpack.perf.step import PARTS
from thdpack.perf.suggest import options


def test_options_hold_the_longest_sequence_and_respect_the_heads():
    llama = NAMED_SHAPES["llama3-8b"]  # 32 heads
    found = options(16, llama, longest=20_000, rank_tokens=8192)
    assert {cp for _, cp, _ in found} == {4, 8, 16}  # cp 1 and 2 cannot hold 20,000 tokens
    assert ("a2a", 8, "a2a") in found and ("mesh", 16, "ring") in found and ("a2a", 16, "a2a") in found
    assert ("auto", 8, "ring") in found
    gpt = NAMED_SHAPES["megatron-dcp-gpt"]  # 16 heads: no all-to-all over 32 ranks
    assert ("a2a", 32, "a2a") not in options(32, gpt, longest=100, rank_tokens=8192)
    assert ("te", 1, "none") in options(32, gpt, longest=100, rank_tokens=8192)


def test_plan_suggest_prints_every_option_and_the_fastest(capsys, tmp_path):
    lengths = np.random.default_rng(0).integers(50, 3000, 400)
    np.save(tmp_path / "l.npy", lengths)
    out_json = tmp_path / "options.json"
    argv = ["plan", "--suggest", str(tmp_path / "l.npy"), "--model", "megatron-dcp-gpt", "--profile", "h100_sxm",
            "--gpus", "8", "--rank-tokens", "4096", "--json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| dp | cp | placement | K/V |" in out and "suggested: dp=" in out
    rows = json.loads(out_json.read_text())
    speeds = [r["tokens_per_s_per_gpu"] for r in rows]
    assert speeds == sorted(speeds, reverse=True)
    assert {r["mode"] for r in rows} == {"te", "adaptive", "a2a", "auto", "mesh"}
    for r in rows:  # the breakdown adds up to the step
        parts = sum(r[f"{p}_ms"] for p in PARTS)
        assert abs(parts - r["step_ms"]) < 1e-6 * r["step_ms"]


def test_plan_suggest_errors_are_messages(capsys, tmp_path):
    assert main(["plan", "--suggest", str(tmp_path / "none.npy"), "--gpus", "8"]) == 2
    assert "thdpack plan: error: " in (err := capsys.readouterr().err) and "none.npy does not exist" in err
    np.save(tmp_path / "l.npy", np.array([100, 200]))
    assert main(["plan", "--suggest", str(tmp_path / "l.npy"), "--gpus", "8", "--profile", "tpu"]) == 2
    assert "unknown profile 'tpu'" in capsys.readouterr().err
    np.save(tmp_path / "long.npy", np.array([100, 90_000]))
    assert main(["plan", "--suggest", str(tmp_path / "long.npy"), "--gpus", "2", "--rank-tokens", "1024"]) == 2
    assert "no option fits: the longest sequence has 90,000 tokens" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--gpus", "--gpus-per-node", "--rank-tokens", "--micro-batches"])
def test_plan_suggest_names_an_option_below_one(capsys, tmp_path, flag):
    np.save(tmp_path / "l.npy", np.array([100, 200]))
    args = {"--gpus": "8", flag: "0"}
    assert main(["plan", "--suggest", str(tmp_path / "l.npy"), *(x for kv in args.items() for x in kv)]) == 2
    assert f"thdpack plan: error: {flag} must be >= 1, got 0" in capsys.readouterr().err


def test_plan_suggest_refuses_a_negative_length_and_counts_the_empty_ones(capsys, tmp_path):
    np.save(tmp_path / "neg.npy", np.array([5, -3, 100, -1]))
    assert main(["plan", "--suggest", str(tmp_path / "neg.npy"), "--gpus", "8"]) == 2
    expected = f"{tmp_path / 'neg.npy'}: sequence 1 has length -3 (2 negative in all); a length counts tokens"
    assert expected in capsys.readouterr().err
    np.save(tmp_path / "zeros.npy", np.array([0, 0, *range(100, 4100, 10)]))
    assert main(["plan", "--suggest", str(tmp_path / "zeros.npy"), "--gpus", "2", "--model", "tiny"]) == 0
    assert "skipped 2 empty sequences (length 0)" in capsys.readouterr().out
