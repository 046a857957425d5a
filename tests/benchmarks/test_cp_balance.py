"""benchmarks/cp_balance.py: the work it counts is exact, and its --tiny mode runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from thdpack.cp import partition_indices
from thdpack.format_rules import round_up_to_cp

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cp_balance.py"
spec = importlib.util.spec_from_file_location("cp_balance", SCRIPT)
cp_balance = importlib.util.module_from_spec(spec)
sys.modules["cp_balance"] = cp_balance
spec.loader.exec_module(cp_balance)


def _brute_force_te_pairs(real: np.ndarray, cp_size: int) -> np.ndarray:
    """Causal real-token pairs per rank, token by token, from thdpack's real partition."""
    padded = round_up_to_cp(real, cp_size)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(padded)]), dtype=torch.int32)
    starts = np.repeat(cu[:-1].numpy(), padded)
    position = np.arange(int(padded.sum())) - starts
    real_of_token = np.repeat(real, padded)
    pairs = []
    for rank in range(cp_size):
        index = partition_indices(cu, int(padded.sum()), cp_size, rank).numpy()
        real_tokens = position[index] < real_of_token[index]
        pairs.append(int((position[index][real_tokens] + 1).sum()))
    return np.array(pairs)


@given(st.lists(st.integers(1, 300), min_size=1, max_size=12), st.sampled_from([2, 3, 4, 8]))
def test_every_layout_counts_each_causal_pair_once(lengths, cp_size):
    real = np.array(lengths, dtype=np.int64)
    total = int((real * (real + 1) // 2).sum())
    pack_size = int(round_up_to_cp(real, cp_size).sum())
    pack_size += -pack_size % (2 * cp_size)
    te = cp_balance.te_layout(real, cp_size)
    assert te["pairs"].tolist() == _brute_force_te_pairs(real, cp_size).tolist()
    assert int(cp_balance.contiguous_split(real, pack_size, cp_size)["pairs"].sum()) == total
    placed = cp_balance.document_placement(real, cp_size)
    assert int(placed["pairs"].sum()) == total and int(placed["tokens"].sum()) == int(real.sum())


def test_tiles_of_one_long_sequence():
    """One 1024-token sequence, cp 2: chunk 256; step 0 a causal 512 x 512 tile (4 blocks: 10
    tiles), step 1 a 512 x 256 tile (8 tiles): 18 tiles on each rank."""
    te = cp_balance.te_layout(np.array([1024]), 2)
    assert te["tiles"].tolist() == [18, 18]
    assert te["tokens"].tolist() == [512, 512]


@pytest.mark.slow
def test_tiny_mode_runs(tmp_path, capsys):
    assert cp_balance.main(["--tiny", "--cp-sizes", "2", "4", "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    assert "| te |" in out and (tmp_path / "out.json").exists()
