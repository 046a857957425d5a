"""The ``CpTopology`` of a Trainer's processes: from accelerate's ``ParallelismConfig`` (its ``"cp"``
mesh dimension) or from thdpack's own ``cp_size``.

Rank ``r`` is CP rank ``r % cp_size`` of DP replica ``r // cp_size`` either way: accelerate orders
its mesh ``dp_replicate, dp_shard, cp, ...``, and thdpack's own mesh is ``(dp, cp)``. The
gradient reduction DDP or FSDP does (through accelerate) averages over every process, CP ranks
included, which ``StepLoss`` compensates for with the topology's ``grad_average_size`` (the world
size).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from thdpack.cp.topology import CpTopology, dp_size_for


def accelerator_topology(accelerator: Any, cp_size: int | None, *, placement_groups: bool) -> CpTopology:
    """This process's topology from accelerate's ``ParallelismConfig`` (its ``"cp"`` mesh
    dimension) or ``cp_size``; raises ``ValueError`` for sizes that disagree or parallelisms
    thdpack cannot serve. Collective where it makes groups (every process calls it):
    thdpack's own (dp, cp) mesh, and with ``placement_groups`` the placement groups of every CP
    group (``CpTopology.create`` / ``from_groups``)."""
    world = accelerator.num_processes
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
    dp_size_for(world, size)  # before any collective: every process refuses alike
    if accelerate_cp > 1:
        cp_group = accelerator.torch_device_mesh["cp"].get_group()
        return CpTopology.from_groups(cp_group=cp_group, placement_groups=placement_groups)
    if size > 1:
        return CpTopology.create(size, device_type=accelerator.device.type, placement_groups=placement_groups)
    if dist.is_initialized():  # data parallelism only: no group to make
        return CpTopology.from_groups(cp_group=None, placement_groups=False)
    return CpTopology.single()
