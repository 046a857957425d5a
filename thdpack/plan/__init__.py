"""Packing plans: which sequences share a pack. Pure numpy; no torch import.

``plan_packs`` is the entry point (``plan_with`` takes its settings as one ``PlanConfig``);
``plan_size_classes`` (or ``plan_histogram``) + ``materialize`` are the length-class engine
underneath it (bfd / ffd, then the improvement phase of ``thdpack.plan.improve``), usable on their
own for datasets known only by histogram; the lower bounds are in ``thdpack.plan.bounds``. With
``cp_placement="adaptive"`` a plan also carries a ``thdpack.layout.CpPlacement``: which CP ranks
each sequence runs on (docs/design/cp_placement.md).
"""

from __future__ import annotations

from thdpack.plan.api import as_lengths, plan_packs, plan_with
from thdpack.plan.assignment import materialize
from thdpack.plan.bounds import l2_lower_bound
from thdpack.plan.config import ALGORITHMS, CP_PLACEMENTS, DEFAULT_WINDOW, Algorithm, CpPlacementMode, PlanConfig
from thdpack.plan.cp_cost import COST_MODELS, CostModel
from thdpack.plan.histogram import FITS, HistogramPlan
from thdpack.plan.overflow import OVERFLOWS, Overflow
from thdpack.plan.packing_stats import PackingStats
from thdpack.plan.packplan import PackPlan
from thdpack.plan.size_classes import plan_histogram, plan_size_classes

__all__ = [
    "ALGORITHMS",
    "COST_MODELS",
    "CP_PLACEMENTS",
    "DEFAULT_WINDOW",
    "FITS",
    "OVERFLOWS",
    "Algorithm",
    "CostModel",
    "CpPlacementMode",
    "HistogramPlan",
    "Overflow",
    "PackPlan",
    "PackingStats",
    "PlanConfig",
    "as_lengths",
    "l2_lower_bound",
    "materialize",
    "plan_histogram",
    "plan_packs",
    "plan_size_classes",
    "plan_with",
]
