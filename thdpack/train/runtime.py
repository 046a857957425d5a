"""The process's place in the run: torchrun environment, process group, dp x cp DeviceMesh.

    torchrun --nproc-per-node 4 -m thdpack.train parallel.cp_size=2   # dp 2 x cp 2

Rank ``r`` sits at mesh coordinate ``(r // cp_size, r % cp_size)``: the ranks of one CP group are
consecutive, so on a multi-GPU node they share the fastest links (CP talks every layer).
Without torchrun (``python -m thdpack.train``) the run is one process on its own gloo group.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from thdpack.cp.comm import create_placement_groups
from thdpack.plan.config import CpPlacementMode
from thdpack.train.config import ParallelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtime:
    """Ranks, groups and device of this process."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    dp_size: int
    cp_size: int
    dp_rank: int
    cp_rank: int
    mesh: DeviceMesh
    cp_group: dist.ProcessGroup
    """The ranks that hold the same packs, each a CP shard of them."""
    dp_group: dist.ProcessGroup
    """The ranks with the same CP position in different data-parallel replicas."""
    world_mesh: DeviceMesh
    """1-D mesh over all dp x cp ranks: what FSDP2 shards over (CP ranks hold the same weights)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        dist.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_runtime(parallel: ParallelConfig, *, cp_placement: CpPlacementMode = "te") -> Runtime:
    """Join (or create) the process group and build the dp x cp mesh; validates the sizes. With
    ``cp_placement="adaptive"`` also the process groups of the smaller groups of CP ranks a
    sequence may be split over (``thdpack.cp.comm.create_placement_groups``; cp >= 4)."""
    launched = dist.is_initialized() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world_size % parallel.cp_size:
        hint = "set parallel.cp_size=1 or launch with torchrun" if not launched else "adjust either"
        raise ValueError(
            f"parallel.cp_size={parallel.cp_size} does not divide the world size {world_size} "
            f"({'torchrun' if launched else 'a single process'}); {hint}"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
    use_cuda = parallel.device == "cuda" or (parallel.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("parallel.device=cuda but CUDA is not available; use parallel.device=cpu")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = parallel.backend if parallel.backend != "auto" else ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise ValueError("parallel.backend=nccl needs CUDA; use parallel.backend=gloo on CPU")
    if parallel.dp_sharding == "fsdp" and device.type == "cpu" and backend != "gloo":
        raise ValueError("FSDP on CPU needs the gloo backend")
    if not dist.is_initialized():
        kwargs = {"timeout": datetime.timedelta(minutes=30)}
        if launched:
            dist.init_process_group(backend, **kwargs)
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, **kwargs
            )
    rank = dist.get_rank()
    cp_size = parallel.cp_size
    dp_size = world_size // cp_size
    mesh = init_device_mesh(device.type, (dp_size, cp_size), mesh_dim_names=("dp", "cp"))
    runtime = Runtime(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        dp_size=dp_size,
        cp_size=cp_size,
        dp_rank=rank // cp_size,
        cp_rank=rank % cp_size,
        mesh=mesh,
        cp_group=mesh.get_group("cp"),
        dp_group=mesh.get_group("dp"),
        world_mesh=init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp_cp",)),
    )
    if mesh.get_local_rank("cp") != runtime.cp_rank or mesh.get_local_rank("dp") != runtime.dp_rank:
        raise AssertionError("DeviceMesh placed this rank elsewhere than rank // cp_size, rank % cp_size")
    if cp_placement == "adaptive":
        create_placement_groups([list(range(d * cp_size, (d + 1) * cp_size)) for d in range(dp_size)])
    return runtime


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
