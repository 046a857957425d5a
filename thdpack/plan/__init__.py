"""Packing plans: which sequences share a pack. Pure numpy; no torch import.

``plan_packs`` is the entry point (``plan_with`` takes its settings as one ``PlanConfig``), and
returns a ``PackPlan`` with its ``PackingStats``. ``plan_histogram`` + ``materialize`` are the
length-class engine underneath it (bfd / ffd, then the improvement phase of
``thdpack.plan.improve``), usable on their own for datasets known only by histogram
(``thdpack.plan.size_classes.plan_size_classes`` from the distinct sizes alone); the lower bounds
are in ``thdpack.plan.bounds``. With ``cp_placement="adaptive"`` a plan also carries a
``thdpack.layout.CpPlacement``: which CP ranks each sequence runs on
(docs/design/cp_placement.md; the cost models: ``thdpack.plan.cp_cost``).
"""

from __future__ import annotations

from thdpack.plan.api import plan_packs, plan_with
from thdpack.plan.assignment import materialize
from thdpack.plan.bounds import l2_lower_bound
from thdpack.plan.config import ALGORITHMS, CP_PLACEMENTS, PlanConfig
from thdpack.plan.histogram_plan import HistogramPlan
from thdpack.plan.overflow import OVERFLOWS
from thdpack.plan.packing_stats import PackingStats
from thdpack.plan.packplan import PackPlan
from thdpack.plan.size_classes import plan_histogram

__all__ = [
    "ALGORITHMS",
    "CP_PLACEMENTS",
    "OVERFLOWS",
    "HistogramPlan",
    "PackPlan",
    "PackingStats",
    "PlanConfig",
    "l2_lower_bound",
    "materialize",
    "plan_histogram",
    "plan_packs",
    "plan_with",
]
