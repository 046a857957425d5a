"""An all-to-all CP attention probe: ``torchrun --nproc-per-node 2 tests/distributed/a2a_probe.py``.

Each rank attends its shard with ``cp_comm_type="a2a"`` (gloo, fp64, forward and backward), prints
its largest error against the single-process oracle and exits right after, without tearing the
process group down: the way a user's script ends. ``tests/distributed/test_cp_teardown.py`` runs it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared case builders
from thdpack.attention import reference_attention, thd_attention

from support.attention_cases import make_thd, random_case, shard_of

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    thd = make_thd([5, 1, 40, 17, 9], world)
    case = random_case(thd, 4, 2, 16, torch.float64, seed=0)
    local, index = shard_of(thd, world, rank)
    q, k, v = (case[n][index].clone().requires_grad_() for n in ("q", "k", "v"))
    out = thd_attention(q, k, v, local, backend="math", cp_group=dist.group.WORLD, cp_comm_type="a2a")
    (out * case["dout"][index]).sum().backward()
    want, _ = reference_attention(case["q"], case["k"], case["v"], thd)
    error = float((out.detach() - want[index])[case["valid"][index]].abs().max())
    print(f"rank {rank}: max error {error:.1e}", flush=True)
