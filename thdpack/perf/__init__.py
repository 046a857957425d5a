"""thdpack.perf: how long a context-parallel training step takes on a given machine (numpy only).

- ``machine``: a machine's public constants (``MachineProfile``, ``load_profile``), every number cited;
- ``shape``: a model's FLOPs and bytes per token (``ModelShape``, ``load_shape``);
- ``kernels`` / ``comm``: kernel times against block sizes, sends and collectives between ranks;
- ``host``: the eager ops a training stack issues on the host (``HostOps``: thdpack's own, Megatron-LM
  on Transformer Engine), which the profile prices per op;
- ``costs``: per-sequence seconds on each rank (``SequenceCosts``: ``whole``, ``split(g)``), the
  pieces a planner's cost model adds up;
- ``mesh`` / ``step``: what every rank of a dp x cp mesh runs (``MeshRun``) and the whole-step
  model over it (``StepModel``): per rank and round, the slowest rank, the barrier, the DP reduction;
- ``modes``: thdpack's planners as mesh runs (``te``, ``adaptive``, ``a2a``, ``mesh``);
- ``megatron``: Megatron-LM's two sequence-packing schedulers as mesh runs;
- ``suggest``: ``thdpack plan --suggest``.

>>> from thdpack.perf import StepModel, Topology, load_profile, NAMED_SHAPES
>>> profile = load_profile("h100_sxm")
>>> model = StepModel(profile, NAMED_SHAPES["llama3-8b"], Topology.of(profile))
>>> round(model.dp_reduce_seconds(8) * 1e3)     # fp32 gradients of 8B parameters over one node's NVLink
125
"""

from __future__ import annotations

from thdpack.perf.comm import Comm, Topology
from thdpack.perf.costs import SequenceCosts, split_slot
from thdpack.perf.host import HOST_STACKS, MEGATRON_TE, THDPACK, THDPACK_CPU, HostOps
from thdpack.perf.kernels import KernelTimes
from thdpack.perf.machine import PROFILE_NAMES, MachineProfile, load_profile
from thdpack.perf.megatron import MEGATRON_SPEC, SCHEDULERS, lognormal_lengths, scheduler_run
from thdpack.perf.mesh import COMMS, MeshRun, placed_run
from thdpack.perf.modes import MODES, mode_run, plan_mode
from thdpack.perf.shape import NAMED_SHAPES, ModelShape, load_shape
from thdpack.perf.step import PARTS, StepModel, StepTimes, TrainingSpec

__all__ = [
    "COMMS",
    "HOST_STACKS",
    "MEGATRON_SPEC",
    "MEGATRON_TE",
    "MODES",
    "NAMED_SHAPES",
    "PARTS",
    "PROFILE_NAMES",
    "SCHEDULERS",
    "THDPACK",
    "THDPACK_CPU",
    "Comm",
    "HostOps",
    "KernelTimes",
    "MachineProfile",
    "MeshRun",
    "ModelShape",
    "SequenceCosts",
    "StepModel",
    "StepTimes",
    "Topology",
    "TrainingSpec",
    "load_profile",
    "load_shape",
    "lognormal_lengths",
    "mode_run",
    "placed_run",
    "plan_mode",
    "scheduler_run",
    "split_slot",
]
