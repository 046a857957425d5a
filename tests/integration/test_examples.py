"""The examples under real launches: ``examples/trl_sft_cp.py --tiny`` with ``torchrun
--nproc-per-node 2`` (TRL's SFTTrainer, thdpack's packing, CP 2 over gloo) trains, logs a falling
loss and writes a checkpoint with the pack stream's state."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the TRL example needs thdpack[trl] (transformers, trl, accelerate)")

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]


def test_trl_example_trains_at_cp_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["examples/trl_sft_cp.py", "--tiny", "--output-dir", str(tmp_path)]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    summary = re.search(
        r"trained 3 steps at dp 1 x cp 2 \(thdpack attention\): loss ([\d.]+) -> ([\d.]+)", result.stdout
    )
    assert summary, result.stdout[-4000:]
    first, last = map(float, summary.groups())
    assert last < first, f"the loss did not fall: {first} -> {last}"
    state = json.loads((tmp_path / "checkpoint-3" / "thdpack_stream.json").read_text())
    assert state["state"]["steps_done"] == 3
