"""The dp x cp layout of a Trainer's processes: from accelerate's ``ParallelismConfig`` (its ``"cp"``
mesh dimension) or from thdpack's own ``cp_size``.

Rank ``r`` is CP rank ``r % cp_size`` of DP replica ``r // cp_size`` either way: accelerate orders
its mesh ``dp_replicate, dp_shard, cp, ...``, and thdpack's own mesh is ``(dp, cp)``. The
gradient reduction DDP or FSDP does (through accelerate) averages over every process, CP ranks
included, which ``StepLoss`` compensates for with ``grad_average_size`` = the world size.

So the CP groups are the runs of ``cp_size`` consecutive ranks (``ParallelLayout.cp_groups``),
which a per-sequence CP placement needs on every process to create the process groups of its
smaller groups of ranks (``thdpack.cp.comm.create_placement_groups``).

>>> ParallelLayout(dp_size=2, dp_rank=0, cp_size=4, cp_rank=1, cp_group=None, grad_average_size=8).cp_groups
[[0, 1, 2, 3], [4, 5, 6, 7]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelLayout:
    """This process's place in dp x cp: rank ``r`` is CP rank ``r % cp_size`` of DP replica ``r // cp_size``."""

    dp_size: int
    dp_rank: int
    cp_size: int
    cp_rank: int
    cp_group: dist.ProcessGroup | None
    """The ranks that share packs (None without CP)."""
    grad_average_size: int
    """Ranks DDP / FSDP average gradients over: all of them (``StepLoss``'s G)."""

    @property
    def cp_groups(self) -> list[list[int]]:
        """The global ranks of every CP group of the run, DP replica by DP replica."""
        return [list(range(d * self.cp_size, (d + 1) * self.cp_size)) for d in range(self.dp_size)]


def parallel_layout(accelerator: Any, cp_size: int | None) -> ParallelLayout:
    """The dp x cp layout from accelerate's ``ParallelismConfig`` (its ``"cp"`` mesh dimension) or
    ``cp_size``; raises ``ValueError`` for sizes that disagree or parallelisms thdpack cannot serve."""
    world, rank = accelerator.num_processes, accelerator.process_index
    config = accelerator.parallelism_config
    if config is not None and (config.tp_size > 1 or config.sp_size > 1):
        raise ValueError(
            f"ParallelismConfig has tp_size={config.tp_size}, sp_size={config.sp_size}: thdpack's packed batches "
            "support data and context parallelism only; set both to 1"
        )
    accelerate_cp = config.cp_size if config is not None else 1
    if cp_size is not None and accelerate_cp > 1 and cp_size != accelerate_cp:
        raise ValueError(
            f"PackingArguments(cp_size={cp_size}) disagrees with ParallelismConfig(cp_size={accelerate_cp}); set one"
        )
    size = accelerate_cp if accelerate_cp > 1 else (cp_size or 1)
    if world % size:
        raise ValueError(f"cp_size={size} does not divide the {world} processes; launch a multiple of it")
    group = None
    if accelerate_cp > 1:
        cp_mesh = accelerator.torch_device_mesh["cp"]
        group = cp_mesh.get_group()
        if cp_mesh.get_local_rank() != rank % size:
            raise AssertionError("accelerate's cp mesh does not place rank r at r % cp_size")
    elif size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(accelerator.device.type, (world // size, size), mesh_dim_names=("dp", "cp"))
        group = mesh.get_group("cp")
    layout = ParallelLayout(
        dp_size=world // size,
        dp_rank=rank // size,
        cp_size=size,
        cp_rank=rank % size,
        cp_group=group,
        grad_average_size=world,
    )
    members = dist.get_process_group_ranks(group) if group is not None else None
    if members is not None and members != layout.cp_groups[layout.dp_rank]:
        raise AssertionError(
            f"the CP group of rank {rank} holds ranks {members}, not the run of cp_size={size} consecutive ranks "
            f"{layout.cp_groups[layout.dp_rank]} that the dp x cp layout assumes"
        )
    return layout
