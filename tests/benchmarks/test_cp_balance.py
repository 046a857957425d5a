"""benchmarks/cp_balance.py: the work it counts is exact, and its --tiny mode runs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from thdpack.cp import partition_indices
from thdpack.layout.placement import PackPlacement
from thdpack.layout.rules import round_up_to_cp

from support.benchmarks import load_benchmark

cp_balance = load_benchmark("cp_balance")


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


def test_ring_bytes_count_only_split_sequences_within_their_group():
    placement = PackPlacement.from_groups([100, 60, 8], {(0, 4): [0], (2, 2): [1], (0, 1): [2]}, cp_size=4,
                                          pack_size=256).as_plan()  # fmt: skip
    # ranks 2, 3 receive 3/4 of the 104-token slot and 1/2 of the 60-token one
    per_token = cp_balance.RING_BYTES_PER_TOKEN
    assert cp_balance.ring_bytes(placement).tolist() == [(78 + 30) * per_token]
    whole = PackPlacement.from_groups([100, 60], {(0, 1): [0], (1, 1): [1]}, cp_size=4, pack_size=512).as_plan()
    assert cp_balance.ring_bytes(whole).tolist() == [0]  # a pack with no split sequence moves nothing


@pytest.mark.slow
def test_tiny_mode_runs(tmp_path, capsys):
    assert cp_balance.main(["--tiny", "--cp-sizes", "2", "4", "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    assert "| te |" in out and "| adaptive |" in out and "| a2a |" in out
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert {row["data"] for row in rows} >= {"stdlib (long documents)"}
    for row in rows:
        for mode in cp_balance.MODES:
            assert row[mode]["busiest_rank_tiles"] > 0
        assert row["adaptive"]["busiest_rank_tiles"] <= row["te"]["busiest_rank_tiles"]
        assert row["adaptive"]["packs"] <= row["te"]["packs"]
        assert row["adaptive"]["kv_bytes_per_pack"] * row["adaptive"]["packs"] <= (
            row["te"]["kv_bytes_per_pack"] * row["te"]["packs"]
        )


def test_lengths_file_is_measured_alone(tmp_path, capsys):
    path = tmp_path / "mine.txt"
    path.write_text("\n".join(map(str, np.random.default_rng(0).integers(1, 900, 300))))
    out_json = tmp_path / "out.json"
    assert cp_balance.main(["--lengths", str(path), "--pack-size", "2048", "--cp-sizes", "4", "--json",
                            str(out_json)]) == 0  # fmt: skip
    rows = json.loads(out_json.read_text())["rows"]
    assert [(row["data"], row["pack_size"], row["cp_size"]) for row in rows] == [("mine.txt", 2048, 4)]
    assert rows[0]["adaptive"]["tiles_vs_te"] <= 1.0
