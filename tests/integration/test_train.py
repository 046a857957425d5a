"""The real entry point under torchrun: 2 CPU processes, cp 2 and dp 2, resume, exactness.

Each launch is a real ``python -m torch.distributed.run ... -m thdpack.train`` with Hydra
overrides: a tiny model, short packs and the first stdlib files keep a launch to seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]
TINY = [
    "model.dim=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.ffn_dim=64",
    "packing.pack_size=256",
    "data.limit=60",
    "train.micro_batches=2",
    "train.warmup_steps=2",
    "train.lr=1e-2",
    "train.log_every=1",
    "train.plot=false",
]


def torchrun(
    tmp: Path, cache: Path, *overrides: str, nproc: int = 2, check: bool = True
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "thdpack.train",
        *TINY,
        f"data.cache_dir={cache}",
        f"train.output_dir={tmp}",
        *overrides,
    ]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("parallel", [["parallel.cp_size=2"], ["parallel.cp_size=1"]], ids=["cp2", "dp2"])
def test_loss_decreases_and_is_finite(tmp_path, cache, parallel):
    result = torchrun(tmp_path, cache, "train.steps=8", "train.checkpoint_every=0", *parallel)
    values = losses(tmp_path)
    assert len(values) == 8
    assert all(v == v and v < 20 for v in values)  # finite
    assert values[-1] < values[0] - 0.5
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "loss", "tokens_per_s", "efficiency"} <= set(records[0])
    assert all(0.9 < r["efficiency"] <= 1.0 for r in records)
    assert "packing plan (epoch 0)" in result.stdout and "one document per 256-token row" in result.stdout
    assert (tmp_path / "checkpoints" / "latest").exists()


def test_resume_gives_identical_losses(tmp_path, cache):
    straight, split = tmp_path / "straight", tmp_path / "split"
    torchrun(straight, cache, "train.steps=6", "train.checkpoint_every=3")
    torchrun(split, cache, "train.steps=6", "train.checkpoint_every=3", "train.stop_at=4")
    # as if killed while saving step 4 (its files written, not its manifest): resume from step 3
    (split / "checkpoints" / "step_000004" / "checksums.json").unlink()
    result = torchrun(split, cache, "train.steps=6", "train.checkpoint_every=3", "train.resume=true")
    assert "step_000003 (step 3)" in result.stdout
    assert losses(split) == losses(straight)


def test_adaptive_cp_placement_trains_and_resumes_exactly(tmp_path, cache):
    """packing.cp_placement=adaptive under torchrun, cp 2 with DDP: short sequences whole on one
    rank, long ones split; a run stopped at step 4 and resumed gives the straight run's losses."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    adaptive = ("parallel.cp_size=2", "packing.cp_placement=adaptive", "train.steps=6", "train.checkpoint_every=3")
    result = torchrun(straight, cache, *adaptive)
    assert "cp placement: adaptive (tiles): " in result.stdout and "split over a group of ranks" in result.stdout
    values = losses(straight)
    assert len(values) == 6 and all(v == v for v in values) and values[-1] < values[0]
    torchrun(split, cache, *adaptive, "train.stop_at=4")
    result = torchrun(split, cache, *adaptive, "train.resume=true")
    assert "(step 4)" in result.stdout
    assert losses(split) == values


def test_bad_config_is_a_message(tmp_path, cache):
    result = torchrun(tmp_path, cache, "packing.pack_size=258", check=False)
    assert result.returncode != 0
    assert "pack_size=258 is not a multiple of 2*cp_size=4" in result.stderr
    result = torchrun(tmp_path, cache, "parallel.cp_size=4", check=False)
    assert "cp_size=4 does not divide the world size 2; launch a multiple of 4 processes" in result.stderr
