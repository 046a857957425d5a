"""``thdpack.perf.host.THDPACK``'s counts of the CP paths that talk (the ring's exchanges, the
all-gather and the all-to-all), recounted in two real processes (gloo)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from thdpack.attention.api import thd_attention
from thdpack.cp.partition import shard
from thdpack.perf.host import FLASH_TILE, THDPACK, Ops
from thdpack.testing import run_distributed

from support.host_counting import forward_backward_ops, qkv, thd_batch

pytestmark = pytest.mark.distributed


def _counts(rank: int, world: int) -> dict[str, Ops]:
    local = shard(thd_batch([16, 8]), world, rank)
    q, k, v = qkv(local["input_ids"].shape[0])
    out = {}
    for comm in ("p2p", "all_gather", "a2a"):

        def forward(comm: str = comm):
            return thd_attention(q, k, v, local, cp_group=dist.group.WORLD, backend="math", cp_comm_type=comm)

        out[comm] = Ops(*forward_backward_ops(forward))
    return out


def test_ring_exchanges_all_gather_and_all_to_all_issue_the_counted_ops():
    counts = run_distributed(_counts, 2)
    # the counts leave the math tiles out (the kernel's); the stack counts a flash tile per kernel call
    mean_ring = Ops(*(sum(c["p2p"][i] for c in counts) / 2 for i in range(2)))  # the ranks' halves differ
    assert mean_ring == THDPACK.ring_ops(2) - FLASH_TILE.scaled(2)
    assert all(c["all_gather"] == THDPACK.allgather - FLASH_TILE for c in counts)
    assert all(c["a2a"] == THDPACK.a2a - FLASH_TILE for c in counts)
