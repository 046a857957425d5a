"""The process's place in the run: torchrun environment, process group, device, and the dp x cp
``CpTopology``.

    torchrun --nproc-per-node 4 -m thdpack.train parallel.cp_size=2   # dp 2 x cp 2

Without torchrun the run is one process on its own gloo group. Every process group of the run
waits ``parallel.timeout_s`` for a collective (torch would give a subgroup its backend's default,
30 minutes for gloo); the long waits before training (the local main rank building the token
cache) go through ``Runtime.long_barrier``, a group without that limit.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from thdpack.cp.comm import release_collectives
from thdpack.cp.topology import CpTopology, timed_device_mesh
from thdpack.plan.config import CpPlacementMode
from thdpack.train.config import ParallelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtime:
    """Ranks, groups and device of this process."""

    topology: CpTopology
    """This process's place in dp x cp: its coordinates, CP / DP / placement groups and (dp, cp) mesh."""
    local_rank: int
    device: torch.device
    world_mesh: DeviceMesh
    """1-D mesh over all dp x cp ranks: what FSDP2 shards over (CP ranks hold the same weights)."""
    long_wait_group: dist.ProcessGroup
    """A gloo group over every rank whose collectives wait a day: see ``long_barrier``."""

    @property
    def is_main(self) -> bool:
        return self.topology.rank == 0

    def barrier(self) -> None:
        dist.barrier()

    def say(self, text: str) -> None:
        """Print a progress line on the main rank only (the run's log on the console)."""
        if self.is_main:
            print(text, flush=True)

    def long_barrier(self) -> None:
        """Wait for every rank, however long the slowest takes (up to a day): the ranks that wait
        while the local main rank tokenizes the cache or verifies a store, before training."""
        dist.barrier(group=self.long_wait_group)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_runtime(parallel: ParallelConfig, *, cp_placement: CpPlacementMode) -> Runtime:
    """Join (or create) the process group and build the dp x cp topology (``CpTopology.create``,
    which validates the sizes); with ``cp_placement="adaptive"`` also the process groups of the
    smaller groups of CP ranks a sequence may be split over (cp >= 4)."""
    launched = dist.is_initialized() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
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
    topology = CpTopology.create(
        parallel.cp_size, device_type=device.type, timeout=timeout, placement_groups=cp_placement != "te"
    )
    return Runtime(
        topology=topology,
        local_rank=local_rank,
        device=device,
        world_mesh=timed_device_mesh(device.type, (topology.world_size,), ("dp_cp",), timeout),
        long_wait_group=dist.new_group(backend="gloo", timeout=LONG_WAIT),
    )


LONG_WAIT = datetime.timedelta(days=1)


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
