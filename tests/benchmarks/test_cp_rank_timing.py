"""benchmarks/cp_rank_timing.py: a rank timed alone with its ring's peers echoed computes exactly the
tiles (shapes, sequence rows, real keys, positions, masks) that rank computes in the real ring.
Its --tiny run is gpu_suite's cp_placement section (tests/benchmarks/test_gpu_suite.py)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import thdpack.attention.math_kernel as math_kernel
import thdpack.attention.ring as ring
from thdpack.attention import simulated_ring_attention
from thdpack.cp import shard
from thdpack.thd import thd_collate
from thdpack.thd.carriage import thd_meta
from thdpack.thd.parts import shard_parts

from support.benchmarks import load_benchmark

cp_rank_timing = load_benchmark("cp_rank_timing")
thd_bench = load_benchmark("thd_bench")


def _side(side):
    return side.counts, side.valid_counts, tuple(side.pos_T.tolist())


@pytest.fixture
def tiles(monkeypatch):
    """Every tile the math kernel computes, per rank: (pass, ring step, q shape, k shape, q side, k side,
    causal); the ring step and rank are those of the ring's last step on the thread (``tiles.local``)."""
    local = threading.local()
    calls: dict[int, list[tuple]] = {}
    plan, forward, backward = ring._tile_plan, math_kernel.tile_forward, math_kernel.tile_backward

    def tile_plan(meta, the_ring, step, causal, scale, device):
        local.rank, local.step = the_ring.rank, step
        return plan(meta, the_ring, step, causal, scale, device)

    def record(kind, q, k, tile):
        shapes = (tuple(q.shape), tuple(k.shape))
        calls.setdefault(local.rank, []).append((kind, local.step, *shapes, _side(tile.q), _side(tile.k), tile.causal))

    def tile_forward(q, k, v, tile):
        record("forward", q, k, tile)
        return forward(q, k, v, tile)

    def tile_backward(dout, q, k, v, lse, delta, tile):
        record("backward", q, k, tile)
        return backward(dout, q, k, v, lse, delta, tile)

    monkeypatch.setattr(ring, "_tile_plan", tile_plan)
    monkeypatch.setattr(math_kernel, "tile_forward", tile_forward)
    monkeypatch.setattr(math_kernel, "tile_backward", tile_backward)
    return SimpleNamespace(calls=calls, local=local)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_an_echoed_rank_computes_the_real_rings_tiles(tiles, cp_size):
    lengths = np.array([5, 30, 3, 17, 1])  # padded slots, a short sequence whose chunks are all padding
    (pack,) = thd_bench.planned_packs(lengths, 128, cp_size, "te")
    thd = thd_collate([pack])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(128, n, 16, generator=g, dtype=torch.float64, requires_grad=True) for n in (4, 2, 2))
    out, _ = simulated_ring_attention(q, k, v, thd, cp_size=cp_size, kernel="math")
    out.backward(torch.randn_like(out))
    real = {rank: list(calls) for rank, calls in tiles.calls.items()}
    tiles.calls.clear()
    case = cp_rank_timing.TINY
    local = cp_rank_timing._qkv(128 // cp_size, 4, 2, case, torch.device("cpu"))
    for rank in range(cp_size):
        cp_rank_timing.rank_attention(thd_meta(shard(thd, cp_size, rank)), local, "math", "math")
    assert sorted(real) == list(range(cp_size)) and tiles.calls == real
    steps = {(kind, step) for kind, step, *_ in real[cp_size - 1]}
    assert steps == {(kind, s) for kind in ("forward", "backward") for s in range(cp_size)}


def test_a_placed_rank_runs_its_split_part_in_a_ring_and_its_whole_part_locally(tiles, monkeypatch):
    whole, attention = [], cp_rank_timing.thd_attention

    def whole_part(q, k, v, batch, *, backend):
        whole.append(q.shape[0])
        tiles.local.step = "whole"  # the math kernel's tiles of the whole part
        return attention(q, k, v, batch, backend=backend)

    monkeypatch.setattr(cp_rank_timing, "thd_attention", whole_part)
    lengths = np.array([40, 3, 2, 5, 1, 4])  # 40 over the 16-token budget of a rank: split
    (pack,) = thd_bench.planned_packs(lengths, 64, 4, "adaptive")
    meta = thd_meta(shard(thd_collate([pack]), 4, 0))
    local = cp_rank_timing._qkv(16, 4, 2, cp_rank_timing.TINY, torch.device("cpu"))
    cp_rank_timing.rank_attention(meta, local, "math", "math")
    split = [part for part in shard_parts(meta) if part.group_size > 1]
    assert split and sum(part.rows.stop - part.rows.start for part in shard_parts(meta)) == 16
    assert whole == [part.rows.stop - part.rows.start for part in shard_parts(meta) if part.group_size == 1]
    forward_steps = [step for kind, step, *_ in tiles.calls[0] if kind == "forward" and step != "whole"]
    assert forward_steps == [s for part in split for s in range(part.group_size)]
