"""``cp_placement="auto"``'s packs: the adaptive packing by the ``time`` or the ``tiles`` cost model,
whichever a timing model says runs faster once each pack takes its fastest way.

The timing model (``PlanTiming``, implemented by ``thdpack.perf.time_cost.TimeCostModel``) is handed
in by the caller, who knows the machine and the model: the planner never loads one itself, so
``plan`` stays below ``perf`` in the import order.

Legend: ``E`` entries, ``P`` packs.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from thdpack.layout.placement import CpPlacement
from thdpack.plan.adaptive import plan_entries
from thdpack.plan.cp_cost import SequenceCostModel


class PlanTiming(SequenceCostModel, Protocol):
    """What a timed plan (``cost_model="time"``, ``cp_placement="auto"``) is given."""

    def choose(self, placement: CpPlacement) -> tuple[CpPlacement, np.ndarray, float]:
        """Per pack the fastest way: ``(placement, a2a_P, seconds)``, the packs that take TE's layout
        split over all ranks, (P,) bool the packs attended by all-to-all, the packs' modelled seconds."""
        ...

    def digest(self) -> str:
        """A digest of everything the timing depends on (the profile's numbers, the shape, the node size)."""
        ...


def plan_auto(
    lengths_E: np.ndarray,
    pack_size: int,
    cp_size: int,
    *,
    timing: PlanTiming,
    algorithm: str,
    window: int,
    rng: np.random.Generator | None,
    improve: bool = True,
) -> tuple[np.ndarray, np.ndarray, CpPlacement, np.ndarray, str]:
    """``plan_packs(..., cp_placement="auto")``'s packs: ``(ids, offsets, placement, a2a_P,
    cost_model)``, the adaptive packing (``plan_entries``) by ``"time"`` or ``"tiles"``, whichever
    is faster after ``timing.choose``, and its name."""
    best = None
    for name, costing in (("time", timing), ("tiles", "tiles")):
        ids, offsets, placement = plan_entries(
            lengths_E, pack_size, cp_size, algorithm=algorithm, window=window, rng=rng, cost_model=costing,
            improve=improve,
        )  # fmt: skip
        placement, a2a_P, seconds = timing.choose(placement)
        if best is None or seconds < best[0]:
            best = (seconds, ids, offsets, placement, a2a_P, name)
    return best[1:]
