"""The process's place in the run: torchrun environment, process group, dp x cp DeviceMesh.

    torchrun --nproc-per-node 4 -m thdpack.train parallel.cp_size=2   # dp 2 x cp 2

Rank ``r`` sits at mesh coordinate ``(r // cp_size, r % cp_size)``: the ranks of one CP group are
consecutive, so on a multi-GPU node they share the fastest links (CP talks every layer).
Without torchrun (``python -m thdpack.train``) the run is one process on its own gloo group.

Every process group of the run waits ``parallel.timeout_s`` for a collective, the mesh's
subgroups included (torch gives a subgroup its backend's default, 30 minutes for gloo, unless
told otherwise). The waits before training that are expected to be long (the local main rank
builds the token cache or verifies a large store while the others wait) go through
``Runtime.long_barrier``, a gloo group without that limit.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from thdpack.cp.comm import create_placement_groups, release_collectives
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
    long_wait_group: dist.ProcessGroup
    """A gloo group over every rank whose collectives wait a day: see ``long_barrier``."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        dist.barrier()

    def long_barrier(self) -> None:
        """Wait for every rank, however long the slowest takes (up to a day): the ranks that wait
        while the local main rank tokenizes the cache or verifies a store, before training."""
        dist.barrier(group=self.long_wait_group)


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
    timeout = datetime.timedelta(seconds=parallel.timeout_s)
    if not dist.is_initialized():
        kwargs = {"timeout": timeout}
        if launched:
            dist.init_process_group(backend, **kwargs)
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, **kwargs
            )
    rank = dist.get_rank()
    cp_size = parallel.cp_size
    dp_size = world_size // cp_size
    mesh = _mesh(device.type, (dp_size, cp_size), ("dp", "cp"), backend, timeout)
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
        world_mesh=_mesh(device.type, (world_size,), ("dp_cp",), backend, timeout),
        long_wait_group=dist.new_group(backend="gloo", timeout=LONG_WAIT),
    )
    if mesh.get_local_rank("cp") != runtime.cp_rank or mesh.get_local_rank("dp") != runtime.dp_rank:
        raise AssertionError("DeviceMesh placed this rank elsewhere than rank // cp_size, rank % cp_size")
    if cp_placement == "adaptive":
        create_placement_groups([list(range(d * cp_size, (d + 1) * cp_size)) for d in range(dp_size)])
    return runtime


LONG_WAIT = datetime.timedelta(days=1)


def _mesh(
    device_type: str, shape: tuple[int, ...], names: tuple[str, ...], backend: str, timeout: datetime.timedelta
) -> DeviceMesh:
    """``init_device_mesh`` whose new subgroups wait ``timeout`` too. A dimension spanning the
    world reuses the default group (which has it) except where torch makes a new one (a gloo
    default group on a machine with CUDA)."""
    world = dist.get_world_size()
    reuses_default = not (torch.cuda.is_available() and dist.get_backend() == "gloo")
    override = {
        name: (backend, _group_options(backend, timeout))
        for name, size in zip(names, shape, strict=True)
        if size != world or not reuses_default
    }
    return init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override or None)


def _group_options(backend: str, timeout: datetime.timedelta) -> Any:
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return options


class RankTimeoutError(RuntimeError):
    """A collective waited ``parallel.timeout_s`` for a rank that did not come."""


def is_collective_timeout(error: BaseException) -> bool:
    """True for the error a collective raises when a rank did not come within the timeout (gloo:
    "Timed out waiting ..."; NCCL: a ``DistBackendError`` from its watchdog)."""
    text = str(error)
    return "Timed out waiting" in text or (isinstance(error, dist.DistBackendError) and "timeout" in text.lower())


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    release_collectives()
