"""Settings that could only end in a silent loss or a hang are refused (issue 17, items 4 and 8,
and the removed ``train.dtype``)."""

from __future__ import annotations

import re
import sys

import pytest

from thdpack.train.config import ParallelConfig, TrainConfig


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"lr": float("inf")}, "train.lr must be a finite number, got inf"),
        ({"lr": float("nan")}, "train.lr must be a finite number, got nan"),
        ({"lr": -1e-3}, "need 0 <= train.min_lr <= train.lr and lr > 0, got lr=-0.001"),
        ({"lr": float("inf"), "min_lr": float("inf")}, "train.lr must be a finite number, got inf"),
        ({"min_lr": -1e-4}, "need 0 <= train.min_lr <= train.lr and lr > 0, got lr=0.003, min_lr=-0.0001"),
        ({"weight_decay": -0.1}, "train.weight_decay must be >= 0, got -0.1"),
        ({"weight_decay": float("nan")}, "train.weight_decay must be a finite number, got nan"),
        ({"weight_decay": float("inf")}, "train.weight_decay must be a finite number, got inf"),
        ({"grad_clip": float("nan")}, "train.grad_clip must be >= 0, got nan"),
        ({"resume_data_changed": True}, "train.resume_data_changed=true applies to a resumed run"),
    ],
)
def test_train_settings_that_cannot_train_are_refused(setting, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(**setting)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"timeout_s": 0}, "parallel.timeout_s must be > 0, got 0"),
        ({"timeout_s": float("inf")}, "parallel.timeout_s must be a finite number, got inf"),
        ({"watchdog_s": -1}, "parallel.watchdog_s must be >= 0, got -1"),
    ],
)
def test_parallel_timeouts_are_checked(setting, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelConfig(**setting)


def test_the_removed_train_dtype_names_its_replacement(monkeypatch, capsys):
    """Before: Hydra's "Could not override 'train.dtype' ... use +train.dtype=bfloat16" (which fails too)."""
    from thdpack.train.__main__ import main

    monkeypatch.setattr(sys, "argv", ["thdpack.train", "train=cpu", "train.dtype=bfloat16"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    said = "thdpack.train: bad config: train.dtype was removed: use train.precision=fp32, bf16-mixed or fp64"
    assert said in capsys.readouterr().err


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("+packing.cp_placment=te", "packing.cp_placment is not a setting (did you mean packing.cp_placement?)"),
        ("+train.lrr=0.1", "train.lrr is not a setting (did you mean train.lr?)"),
        ("+data.tokeniser=gpt2", "data.tokeniser is not a setting (did you mean data.tokenizer?)"),
        ("+trainer.steps=3", "trainer is not a setting (did you mean train?)"),
        ("+train.zzz=1", "train.zzz is not a setting (train has: steps, micro_batches, "),
    ],
)
def test_a_key_added_with_plus_that_the_schema_lacks_is_refused_by_the_real_entry(tmp_path, override, said):
    """Issue 26: Hydra added the key, OmegaConf gave it to no field, and the run trained on the default."""
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "thdpack.train", f"train.output_dir={tmp_path}", "parallel.cp_size=1", override]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"thdpack.train: bad config: {said}" in result.stderr
    assert not any(tmp_path.iterdir())  # refused before anything was written
