"""``thdpack verify`` end to end through ``run_verify``: it launches its own gloo ranks, prints the
table and exits 0 when exact, 1 on a planted layout bug, 2 when a rank fails."""

from __future__ import annotations

import argparse

import pytest
import torch

from thdpack.verify.command import add_verify_arguments, run_verify

pytestmark = pytest.mark.distributed


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_verify_arguments(parser)
    return parser.parse_args(["--device", "cpu", *argv])


@pytest.mark.parametrize(
    "argv",
    [
        ("--cp-size", "2", "--cp-placement", "te"),
        ("--cp-size", "1", "--dp-size", "2", "--dtype", "float32", "--reduction", "sequence_mean"),
        ("--cp-size", "2", "--cp-placement", "te", "--dtype", "bfloat16"),
        # cp 2 a2a: test_models_exactness_distributed; at cp 4 the tiny model's 2 KV heads are sent twice
        ("--cp-size", "4", "--cp-placement", "te", "--cp-comm-type", "a2a"),
    ],
    ids=["cp2-float64", "dp2-float32-sequence-mean", "cp2-bfloat16", "cp4-a2a"],
)
def test_exact_layouts_pass(capsys, argv):
    assert run_verify(_args(*argv)) == 0
    out = capsys.readouterr().out
    assert "thdpack verify: dp " in out and "gloo, cpu" in out
    assert "attention: thdpack attention backend 'math'" in out
    for quantity in (
        "loss",
        "logits",
        "grad embed_tokens.weight",
        "grad layers.1.mlp.down_proj.weight",
        "grad norm.weight",
    ):
        assert f"\n{quantity} " in out
    assert "FAIL" not in out
    assert out.rstrip().splitlines()[-1].startswith("PASS: the packed step equals the unpacked one")


@pytest.mark.parametrize("cp_size", ["3", "4"])
def test_the_adaptive_placement_passes(capsys, cp_size):
    placement = ("--cp-placement", "adaptive") if cp_size == "4" else ()  # cp 3: the default, the trainer's
    assert run_verify(_args("--cp-size", cp_size, *placement)) == 0
    out = capsys.readouterr().out
    assert "cp_placement adaptive" in out and "whole on one rank" in out
    assert f"split over {cp_size}" in out and ("split over 2" in out) == (cp_size == "4")
    assert out.rstrip().splitlines()[-1].startswith("PASS: the packed step equals the unpacked one")


def test_a_planted_fault_exits_non_zero(capsys):
    assert run_verify(_args("--cp-size", "2", "--cp-placement", "te", "--inject-fault", "local_positions")) == 1
    out = capsys.readouterr().out
    assert "injected fault: local_positions" in out
    assert "FAIL: " in out and "the packed step is NOT the unpacked one" in out


def test_a_failing_rank_exits_2_with_its_error(capsys):
    assert run_verify(_args("--cp-size", "2", "--cp-placement", "te", "--backend", "sdpa")) == 2
    err = capsys.readouterr().err
    assert "thdpack verify: error on rank 0: ValueError: backend 'sdpa' has no context-parallel path" in err


def test_bad_requests_raise_before_launching():
    with pytest.raises(ValueError, match=r"fault 'foreign_shard' only exists under context parallelism"):
        run_verify(_args("--cp-size", "1", "--inject-fault", "foreign_shard"))
    with pytest.raises(ValueError, match=r"cp_size must be >= 1, got 0"):
        run_verify(_args("--cp-size", "0"))
    if torch.cuda.device_count() < 64:
        args = _args("--cp-size", "64")
        args.device = "cuda"
        with pytest.raises(ValueError, match=r"--device cuda needs one GPU per rank: 64 ranks \(dp 1 x cp 64\)"):
            run_verify(args)
