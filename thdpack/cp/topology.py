"""``CpTopology``: this process's place in the dp x cp mesh, made once and passed to what needs it.

Rank ``r`` is CP rank ``r % cp_size`` of DP replica ``r // cp_size``: a CP group's ranks are
consecutive, so on a node they share its fastest links (CP talks every layer). Every rank list,
coordinate and process group of the mesh comes from here, and a topology holds its own groups
(no global registry): ``CpTopology(...)`` describes a mesh without groups, :meth:`CpTopology.create`
makes the (dp, cp) ``DeviceMesh`` and the placement groups (the aligned sub-groups a per-sequence
placement splits sequences over), :meth:`CpTopology.from_groups` wraps a framework's CP group.

>>> topology = CpTopology(dp_size=2, cp_size=4, rank=5, gpus_per_node=8)
>>> topology.dp_rank, topology.cp_rank, topology.world_size
(1, 1, 8)
>>> topology.cp_groups
[[0, 1, 2, 3], [4, 5, 6, 7]]
>>> topology.dp_groups
[[0, 4], [1, 5], [2, 6], [3, 7]]
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from thdpack._settings import check_int
from thdpack.layout.rules import group_options, group_sizes


@dataclass(frozen=True, kw_only=True)
class CpTopology:
    """dp x cp ranks, this process's coordinates in them and, when made with process groups, its groups."""

    dp_size: int
    """Data-parallel replicas; each trains its own packs."""
    cp_size: int
    """Context-parallel ranks per replica; they share every pack, one shard each."""
    rank: int
    """This process's global rank, ``dp_rank * cp_size + cp_rank``."""
    gpus_per_node: int
    """Ranks per node (torchrun's ``LOCAL_WORLD_SIZE``): which CP and DP groups cross nodes."""
    cp_group: dist.ProcessGroup | None = None
    """The ranks of this process's CP group (None: described without process groups, or no CP group
    made: one process, or a framework's run without CP)."""
    dp_group: dist.ProcessGroup | None = None
    """The ranks at this process's CP position in every replica (None: not made)."""
    dp_cp_group: dist.ProcessGroup | None = None
    """Every rank of the mesh: the loss's all-reduce and the gradient average (None: not made)."""
    placement_groups: Mapping[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)
    """``{(group_start, group_size): process group}`` of the aligned sub-groups of this process's CP
    group that contain it, smaller than it and larger than one rank (for cp 8: its quad and its pair)."""
    mesh: DeviceMesh | None = None
    """The ("dp", "cp") ``DeviceMesh`` (only from :meth:`create`)."""

    def __post_init__(self) -> None:
        check_int("dp_size", self.dp_size, 1)
        check_int("cp_size", self.cp_size, 1)
        check_int("gpus_per_node", self.gpus_per_node, 1)
        world = self.dp_size * self.cp_size
        if check_int("rank", self.rank, 0) >= world:
            raise ValueError(
                f"rank={self.rank} is outside dp_size={self.dp_size} x cp_size={self.cp_size} = {world} ranks; "
                f"use a rank in 0..{world - 1}"
            )
        if world > self.gpus_per_node and world % self.gpus_per_node:
            raise ValueError(
                f"{world} ranks (dp {self.dp_size} x cp {self.cp_size}) are not whole nodes of gpus_per_node="
                f"{self.gpus_per_node}; launch the same number of ranks on every node"
            )

    @classmethod
    def single(cls) -> CpTopology:
        """One process: dp 1 x cp 1, no process group."""
        return cls(dp_size=1, cp_size=1, rank=0, gpus_per_node=1)

    @classmethod
    def create(
        cls,
        cp_size: int,
        *,
        device_type: str,
        timeout: datetime.timedelta | None = None,
        placement_groups: bool = True,
    ) -> CpTopology:
        """Build the mesh of every process of the default group in CP groups of ``cp_size``.

        Collective: every process calls it, in the same order as its other group creations. Builds
        the (dp, cp) ``DeviceMesh`` on ``device_type`` (``"cpu"`` / ``"cuda"``) and, with
        ``placement_groups``, the placement groups of every CP group (cp >= 4 has some; turn them off
        when no plan of the run can split a sequence over fewer than all CP ranks: ``cp_placement="te"``).
        ``timeout``: how long every new group waits in a collective (None: the backend's default;
        torch gives a subgroup that default, not the default group's timeout).
        """
        if not dist.is_initialized():
            raise ValueError(
                "CpTopology.create makes process groups: call torch.distributed.init_process_group first, or "
                "describe the mesh without them: CpTopology(dp_size=..., cp_size=..., rank=..., gpus_per_node=...)"
            )
        described = cls._this_process(cp_size)
        mesh = timed_device_mesh(device_type, (described.dp_size, cp_size), ("dp", "cp"), timeout)
        if (mesh.get_local_rank("dp"), mesh.get_local_rank("cp")) != (described.dp_rank, described.cp_rank):
            raise AssertionError("DeviceMesh placed this rank elsewhere than rank // cp_size, rank % cp_size")
        return dataclasses.replace(
            described,
            cp_group=mesh.get_group("cp"),
            dp_group=mesh.get_group("dp"),
            dp_cp_group=dist.group.WORLD,
            placement_groups=described._make_placement_groups(timeout) if placement_groups else {},
            mesh=mesh,
        )

    @classmethod
    def from_groups(
        cls,
        *,
        cp_group: dist.ProcessGroup | None,
        dp_group: dist.ProcessGroup | None = None,
        placement_groups: bool = True,
    ) -> CpTopology:
        """The topology around ``cp_group``, a framework's CP group of this process (None: no CP);
        ``dp_group`` its DP group, if it made one (without CP: every process).

        Collective with ``placement_groups`` (every process calls it): the placement groups of every
        CP group are made here. ``ValueError`` when the CP group is not this process's run of
        ``cp_size`` consecutive ranks, the layout thdpack's shards assume.
        """
        if not dist.is_initialized():
            raise ValueError(
                "CpTopology.from_groups needs torch.distributed initialised; CpTopology.single() is one process"
            )
        described = cls._this_process(1 if cp_group is None else dist.get_world_size(cp_group))
        members = described.cp_groups[described.dp_rank]
        if cp_group is not None and dist.get_process_group_ranks(cp_group) != members:
            raise ValueError(
                f"the CP group of rank {described.rank} holds ranks {dist.get_process_group_ranks(cp_group)}, not "
                f"the run of cp_size={described.cp_size} consecutive ranks {members} that thdpack's dp x cp layout "
                "assumes; order the framework's mesh with cp as its last (fastest-varying) dimension"
            )
        return dataclasses.replace(
            described,
            cp_group=cp_group,
            dp_group=dp_group if cp_group is not None else dist.group.WORLD,
            dp_cp_group=dist.group.WORLD,
            placement_groups=described._make_placement_groups(None) if placement_groups else {},
        )

    @classmethod
    def _this_process(cls, cp_size: int) -> CpTopology:
        """This process's coordinates in CP groups of ``cp_size`` over the default group, no group yet."""
        world = dist.get_world_size()
        dp_size = dp_size_for(world, cp_size)
        return cls(dp_size=dp_size, cp_size=cp_size, rank=dist.get_rank(), gpus_per_node=ranks_per_node(world))

    # ---- coordinates and rank lists ----

    @property
    def world_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp_size

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp_size

    @property
    def cp_groups(self) -> list[list[int]]:
        """The global ranks of every CP group, replica by replica."""
        return [list(range(d * self.cp_size, (d + 1) * self.cp_size)) for d in range(self.dp_size)]

    @property
    def dp_groups(self) -> list[list[int]]:
        """The global ranks of every DP group, CP position by CP position."""
        return [list(range(c, self.world_size, self.cp_size)) for c in range(self.cp_size)]

    @property
    def grad_average_size(self) -> int:
        """The ranks thdpack's gradient reduction averages over: every rank (DDP / FSDP2 over the
        flattened dp x cp mesh; CP ranks hold the same weights). The loss's ``G``."""
        return self.world_size

    # ---- process groups ----

    def group(self, start: int, size: int) -> dist.ProcessGroup:
        """The process group of CP ranks ``start .. start + size - 1`` of this process's CP group:
        the CP group itself for ``size == cp_size``, else a placement group. ``ValueError`` naming
        the fix when there is none."""
        if (start, size) == (0, self.cp_size) and self.cp_group is not None:
            return self.cp_group
        if (start, size) in self.placement_groups:
            return self.placement_groups[(start, size)]
        ranks = f"CP ranks {start}..{start + size - 1}"
        if self.cp_group is None:
            problem = "this CpTopology has no process groups (a described mesh)"
            fix = "make it with CpTopology.create (or CpTopology.from_groups) on every process"
        elif size not in group_sizes(self.cp_size) or size == 1 or start % size or not 0 <= start < self.cp_size:
            problem = f"{ranks} are no aligned group of cp_size={self.cp_size}"
            sizes = ", ".join(map(str, group_sizes(self.cp_size)[1:]))
            fix = f"a group has {sizes} ranks and starts at a multiple of its size"
        elif not start <= self.cp_rank < start + size:
            problem = f"{ranks} do not include this process (CP rank {self.cp_rank})"
            fix = "ask for a group of this process's own CP ranks"
        else:
            problem = f"this CpTopology was made without placement groups, and {ranks} need one"
            fix = "make it with placement_groups=True to split sequences over fewer than all CP ranks"
        raise ValueError(f"{problem}; {fix}")

    def _make_placement_groups(self, timeout: datetime.timedelta | None) -> dict[tuple[int, int], dist.ProcessGroup]:
        """Create the process group of every aligned sub-group of every CP group (``dist.new_group``
        is collective over the default group: every process creates every group, in one order:
        CP group by CP group, each largest first); keep this process's."""
        size_O, start_O = group_options(self.cp_size)
        mine = {}
        for ranks in self.cp_groups:
            for size, start in zip(size_O.tolist(), start_O.tolist(), strict=True):
                if size in (1, self.cp_size):
                    continue
                members = ranks[start : start + size]
                group = dist.new_group(members, timeout=timeout)
                if self.rank in members:
                    mine[(start, size)] = group
        return mine


CpGroupLike: TypeAlias = "dist.ProcessGroup | CpTopology"
"""What ``thd_attention`` and the models take as ``cp_group``: the run's :class:`CpTopology`, or a
plain process group (Transformer Engine's layout, or placements that split only over all of it)."""


def dp_size_for(world_size: int, cp_size: int) -> int:
    """The DP replicas of ``world_size`` processes in CP groups of ``cp_size``; ``ValueError``
    unless ``cp_size`` divides it."""
    check_int("cp_size", cp_size, 1)
    if world_size % cp_size:
        raise ValueError(
            f"cp_size={cp_size} does not divide the world size {world_size}; launch a multiple of {cp_size} "
            f"processes (torchrun --nproc-per-node) or use a cp_size that divides {world_size}"
        )
    return world_size // cp_size


def ranks_per_node(world_size: int) -> int:
    """torchrun's ``LOCAL_WORLD_SIZE``; without torchrun the processes were started on this machine."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def timed_device_mesh(
    device_type: str, shape: tuple[int, ...], names: tuple[str, ...], timeout: datetime.timedelta | None
) -> DeviceMesh:
    """``init_device_mesh`` whose new subgroups wait ``timeout`` (None: the backend's default). A
    dimension spanning the world reuses the default group (which has its own timeout) except where
    torch makes a new one (a gloo default group on a machine with CUDA)."""
    if timeout is None:
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    world = dist.get_world_size()
    backend = dist.get_backend()
    reuses_default = not (torch.cuda.is_available() and backend == "gloo")
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
