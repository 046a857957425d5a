"""benchmarks/cp_throughput.py: the three CP modes train the same packs (same tokens, same first
loss), the adaptive packs are the TE packs under a placement, and --tiny runs end to end on two
gloo processes through train_throughput.py --cp 2."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from support.benchmarks import load_benchmark

tt = load_benchmark("train_throughput")
cpt = load_benchmark("cp_throughput")


def test_every_mode_gets_the_same_documents_and_adaptive_places_short_ones_whole():
    cfg = replace(cpt.TINY, pack_size=64, packs_per_step=2)
    pieces = np.array([5, 60, 3, 17, 9, 30, 1, 12, 20, 3, 40, 7], dtype=np.int64)
    steps = cpt.step_packs(pieces, cfg, 2)
    assert len(steps) == 2 and all(len(step) == 2 for step in steps)
    whole = 0
    for step in steps:
        for packs in step:
            te, adaptive = packs["te"], packs["adaptive"]
            assert packs["a2a"] is te
            placed = adaptive["seq_lens"].tolist()
            assert placed[: len(te["seq_lens"])] == te["seq_lens"].tolist()  # then empty padding entries
            assert not any(placed[len(te["seq_lens"]) :])
            real = te["labels"] != -100
            assert sorted(te["input_ids"][real].tolist()) == sorted(
                adaptive["input_ids"][adaptive["labels"] != -100].tolist()
            )
            assert all(n % 4 == 0 for n in te["seq_lens_padded"].tolist())  # TE: every slot a multiple of 2*cp
            whole += int((adaptive["cp_group_size"] == 1).sum())
    assert whole > 0  # short sequences sit whole on one rank


def test_bad_configs_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="multiple of 2\\*cp_size=4"):
        cpt.CpThroughputConfig(pack_size=66)
    with pytest.raises(ValueError, match="cp_size must be >= 2"):
        cpt.CpThroughputConfig(cp_size=1)
    with pytest.raises(ValueError, match="n_heads=4 is not a multiple of cp_size"):
        cpt.CpThroughputConfig(cp_size=3, pack_size=4098)


def test_tiny_runs_through_train_throughput(tmp_path):
    assert tt.main(["--cp", "2", "--tiny", "--steps", "1", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "cp_throughput.json").read_text())
    rows = results[0]["rows"]
    assert [row["mode"] for row in rows] == ["te", "adaptive", "a2a"]
    assert all(row["step_s_median"] > 0 and len(row["step_s"]) == 1 for row in rows)
    assert rows[0]["vs_te"] == 1.0
    losses = [row["first_loss"] for row in rows]
    assert max(losses) - min(losses) < 1e-4 * abs(losses[0])  # one computation, three layouts
    assert "| te (p2p) |" in (tmp_path / "cp_throughput.md").read_text()
