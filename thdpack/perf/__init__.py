"""thdpack.perf: how long a context-parallel training step takes on a given machine (numpy only).

The face holds what a user of the model needs: a machine (``MachineProfile``, ``load_profile``),
a model (``ModelShape``, ``load_shape``), where the ranks sit (``Topology``), what every rank runs
(``MeshRun``: built by ``placed_run`` from placed packs, or by ``mode_run`` / ``plan_mode`` for one
of thdpack's ``MODES``) and the step model over it (``StepModel``, ``TrainingSpec``, ``StepTimes``
broken down by ``PARTS``; ``HOST_STACKS``: the training stacks whose host ops it counts). The
pieces the model is built from live in their modules: ``kernels``, ``comm``, ``costs``, ``host``,
``time_cost`` (the planner's ``time`` cost model), ``megatron`` (Megatron-LM's schedulers as mesh
runs) and ``suggest`` (``thdpack plan --suggest``).

>>> from thdpack.perf import StepModel, Topology, load_profile, NAMED_SHAPES
>>> profile = load_profile("h100_sxm")
>>> model = StepModel(profile, NAMED_SHAPES["llama3-8b"], Topology.of(profile))
>>> round(model.dp_reduce_seconds(8) * 1e3)     # fp32 gradients of 8B parameters over one node's NVLink
125
"""

from __future__ import annotations

from thdpack.perf.comm import Topology
from thdpack.perf.host import HOST_STACKS, HostOps
from thdpack.perf.machine import PROFILE_NAMES, MachineProfile, load_profile
from thdpack.perf.mesh import COMMS, MeshRun, placed_run
from thdpack.perf.modes import MODES, mode_run, plan_mode
from thdpack.perf.shape import NAMED_SHAPES, ModelShape, load_shape
from thdpack.perf.step import PARTS, StepModel, StepTimes, TrainingSpec

__all__ = [
    "COMMS",
    "HOST_STACKS",
    "MODES",
    "NAMED_SHAPES",
    "PARTS",
    "PROFILE_NAMES",
    "HostOps",
    "MachineProfile",
    "MeshRun",
    "ModelShape",
    "StepModel",
    "StepTimes",
    "Topology",
    "TrainingSpec",
    "load_profile",
    "load_shape",
    "mode_run",
    "placed_run",
    "plan_mode",
]
