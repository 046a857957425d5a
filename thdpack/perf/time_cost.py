"""The ``time`` cost model of the CP placement: a sequence's modelled seconds on each rank of its
group and each attention call's, as integer nanoseconds; with ``choose``, the timing a
``cp_placement="auto"`` plan is given (``thdpack.plan.auto.PlanTiming``).

The placement search (``thdpack.plan.place``) adds up per-sequence costs per rank and keeps ties
exact, so this model rounds each cost to whole nanoseconds once; everything after is integer
arithmetic. Forward + backward over every layer, from the step-time model
(``thdpack.perf.step``):

- ``whole(n)``: a sequence's causal attention on one rank;
- ``split(n, slot, g)``: its ring over a group of ``g`` ranks as if it were alone in the group:
  per step the longer of its tile and its K/V (backward also dK/dV) send, the send at the group's
  link (NVLink inside a node, the network per GPU across nodes) with its latency;
- ``call(g)``: what one attention call of a group of ``g`` ranks (1: a rank's local call) costs
  each of its ranks once, however many sequences it attends: on the device its kernel launches
  (one per ring step), on the host its eager ops (``thdpack.perf.host``: per ring step its tile,
  merge and exchanges), ``StepModel.call_seconds``;
- ``host_lead(budget)``: how the device and the host combine on a rank holding ``budget`` tokens.
  A GPU's host launches ahead, so a rank takes the longer of its device work (linear + attention +
  exposed sends) and its host's ops (micro-batch and layers + attention calls); the linear work and
  the micro-batch's and layers' ops are the same on every rank in every placement, so a rank costs
  ``max(device, host + lead)`` of the rest, ``lead`` the host's fixed ops less the linear work. On a
  CPU the two add (``None``).

A rank's time cost (``thdpack.plan.cp_cost.rank_costs``) is then exactly the step model's
attention + exposed communication + host part of that rank for the pack run alone, where each ring
group attends one sequence; sequences that share a group share its sends, so the sum of their
rings bounds the group's from above. Where the host is the bottleneck (short chunks, many ring
steps, groups over the whole mesh) the search sees it and keeps groups small; where the device is,
the host's ops cost nothing. A group of ``g`` ranks spans nodes when ``g > gpus_per_node`` (a CP
group starts on a node boundary): its sends run at the network's bandwidth, so the search prefers
sub-groups inside one node wherever they balance the pack as well.

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
