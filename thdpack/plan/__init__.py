"""Packing plans: which sequences share a pack. Pure numpy; no torch import.

``plan_packs`` is the entry point (``plan_with`` takes its settings as one ``PlanConfig``);
``plan_size_classes`` (or ``plan_histogram``) + ``materialize`` are the length-class engine
underneath it, usable on their own for datasets known only by histogram.
"""

from __future__ import annotations

from thdpack.plan.api import as_lengths, plan_packs, plan_with
from thdpack.plan.assignment import materialize
from thdpack.plan.bounds import l2_lower_bound
from thdpack.plan.config import ALGORITHMS, DEFAULT_WINDOW, Algorithm, PlanConfig
from thdpack.plan.histogram import FITS, HistogramPlan, plan_histogram, plan_size_classes
from thdpack.plan.overflow import OVERFLOWS, Overflow
from thdpack.plan.packing_stats import PackingStats
from thdpack.plan.packplan import PackPlan

__all__ = [
    "ALGORITHMS",
    "DEFAULT_WINDOW",
    "FITS",
    "OVERFLOWS",
    "Algorithm",
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
