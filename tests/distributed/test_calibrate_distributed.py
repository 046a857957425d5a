"""`thdpack calibrate` over two gloo processes: the links between them are measured and the profile
loads, well inside the one minute it may take."""

from __future__ import annotations

import time

import pytest
import torch

from thdpack.calibrate.command import calibrate
from thdpack.perf.machine import COLLECTIVES, load_profile
from thdpack.perf.shape import ModelShape
from thdpack.testing import run_distributed

pytestmark = pytest.mark.distributed

SHAPE = ModelShape(layers=4, hidden=256, ffn=768, heads=4, kv_heads=2, head_dim=64, vocab=8192)


def _calibrate(rank: int, world: int, path: str) -> float:
    started = time.monotonic()
    profile = calibrate(SHAPE, device=torch.device("cpu"), dtype=torch.float32, backend="auto", rank_tokens=1024,
                        base=load_profile("cpu_gloo"), budget_s=20.0, repeats=2)  # fmt: skip
    if rank == 0:
        profile.to_json(path)
    return time.monotonic() - started


def test_two_gloo_ranks_measure_their_link_and_write_a_valid_profile(tmp_path):
    path = tmp_path / "machine.json"
    seconds = run_distributed(_calibrate, 2, str(path))
    assert max(seconds) < 45  # the command's budget is 60 s
    profile = load_profile(path)
    assert profile.gpus_per_node == 2 and profile.intra_node.bandwidth > 1e6
    assert all(0 < profile.collective_factors[c] < 20 for c in COLLECTIVES)
    cited = {key: s.source for s in profile.sources for key in s.keys}
    for key in ("intra_node.bandwidth", "intra_node.latency_s", "collective_factors.all_to_all"):
        assert cited[key].startswith("measured by thdpack calibrate on ")
    assert cited["inter_node.bandwidth"].startswith("from profile cpu_gloo")  # one node: no network to time
