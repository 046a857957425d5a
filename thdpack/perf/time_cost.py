"""The ``time`` cost model of the CP placement: the step-time model cut into what a placement changes.

A sequence's modelled seconds on each rank of its group (``whole``, ``split``), each attention
call's (``call``) and how device and host combine on a rank (``host_lead``), all as integer
nanoseconds, so the placement search (``thdpack.plan.place``) adds them with exact ties. A pack's
time cost per rank is then the step model's attention, exposed communication and host part of it;
with ``choose``, the model also picks each pack's way for ``cp_placement="auto"``
(docs/design/step_model.md, "What the planner sees").

Legend: ``S`` sequences, ``G`` ranks of a group.

>>> cost = TimeCostModel.load("h100_sxm", "llama3-8b", gpus_per_node=8)
>>> cost.whole(np.array([1024, 8192])).tolist()                       # ns
[2814651, 113650421]
>>> inside = cost.split(np.array([8192]), np.array([8192]), 8)
>>> across = TimeCostModel.load("h100_sxm", "llama3-8b", gpus_per_node=4).split(np.array([8192]), np.array([8192]), 8)
>>> inside.shape, int(inside[0, 0]) < int(across[0, 0])                # a group of 8 over two nodes costs more
((1, 8), True)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from thdpack.layout.placement import CpPlacement
from thdpack.perf.auto import choose_layouts
from thdpack.perf.comm import Topology
from thdpack.perf.machine import MachineProfile, load_profile
from thdpack.perf.shape import ModelShape, load_shape
from thdpack.perf.step import StepModel

NANOSECONDS = 1e9


@dataclass(frozen=True, eq=False)
class TimeCostModel:
    """Per-sequence nanoseconds of one model on one machine (module docstring)."""

    model: StepModel

    @classmethod
    def load(cls, profile: str | Path, model_shape: str | Path, gpus_per_node: int | None = None) -> TimeCostModel:
        """The model of a profile (a shipped name or a JSON path) and a model shape (a named shape, a
        thdpack preset or a config.json path); ``gpus_per_node`` default: the profile's."""
        return cls.of(load_profile(profile), load_shape(model_shape), gpus_per_node)

    @classmethod
    def of(cls, profile: MachineProfile, shape: ModelShape, gpus_per_node: int | None = None) -> TimeCostModel:
        return cls(StepModel(profile, shape, Topology.of(profile, gpus_per_node)))

    def whole(self, lengths_S: np.ndarray) -> np.ndarray:
        """(S,) int64 nanoseconds of each sequence whole on one rank (0 for an empty one)."""
        lengths_S = np.asarray(lengths_S, dtype=np.int64)
        out = np.zeros(lengths_S.shape, dtype=np.int64)
        some = lengths_S > 0
        out[some] = _nanoseconds(self.model.costs.attention_whole(lengths_S[some]))
        return out

    def split(self, lengths_S: np.ndarray, slots_S: np.ndarray, group_size: int) -> np.ndarray:
        """(S, G) int64 nanoseconds on each rank of a group of ``group_size`` of each sequence split
        over it (its ``slots_S``, multiples of ``2 * group_size``), alone in the group."""
        if group_size == 1:
            return self.whole(lengths_S)[:, None]
        model = self.model
        slots = np.asarray(slots_S, dtype=np.int64)
        per_rank = np.zeros(slots.shape, dtype=np.int64)
        some = slots > 0
        tiles = model.costs.ring_tiles(slots[some], group_size)
        sent = model.costs.ring_bytes(slots[some], group_size)
        domains = model.topology.domains(np.array([0]), np.array([group_size - 1]))
        forward, backward = model.ring_seconds(tiles, sent, group_size, domains)
        per_rank[some] = _nanoseconds(model.shape.layers * (forward + backward))
        return np.repeat(per_rank[:, None], group_size, axis=1)

    def call(self, group_size: int) -> tuple[int, int]:
        """``(device, host)`` int64 nanoseconds on each rank of one attention call of a group of
        ``group_size`` ranks (``StepModel.call_seconds``)."""
        device, host = self.model.call_seconds(group_size)
        return int(_nanoseconds(device)), int(_nanoseconds(host))

    def host_lead(self, budget: int) -> int | None:
        """Nanoseconds by which a rank's host work beside its attention calls (its micro-batch and
        layers) outlasts its linear work on ``budget`` tokens, where the host launches ahead of the
        device (negative where the device is the longer); None on a host that computes (a CPU)."""
        model = self.model
        if not model.profile.host.asynchronous:
            return None
        host = model.round_host_ops() * model.profile.host.op_s
        return int(_nanoseconds(host - float(model.costs.kernels.linear(budget))))

    def choose(self, placement: CpPlacement) -> tuple[CpPlacement, np.ndarray, float]:
        """Per pack of ``placement`` the fastest way by the step model (``thdpack.perf.auto.choose_layouts``)."""
        return choose_layouts(placement, self.model)

    def digest(self) -> str:
        """sha256 of everything the costs depend on: the profile's numbers, the shape, the node size."""
        model = self.model
        content = {
            "profile": model.profile.to_dict(),
            "shape": asdict(model.shape),
            "topology": asdict(model.topology),
            "spec": asdict(model.spec),
        }
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def _nanoseconds(seconds: np.ndarray) -> np.ndarray:
    return np.rint(np.asarray(seconds, dtype=np.float64) * NANOSECONDS).astype(np.int64)


def timing_of(config: Any, gpus_per_node: int | None = None) -> TimeCostModel | None:
    """The timing a plan config needs (a ``PlanConfig``: its ``profile`` and ``model_shape``, on nodes
    of ``gpus_per_node``), or None when it does not time packs (``config.timed`` is False)."""
    if not config.timed:
        return None
    return TimeCostModel.load(config.profile, config.model_shape, gpus_per_node)
