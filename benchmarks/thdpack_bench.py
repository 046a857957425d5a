"""thdpack's planners as ``--candidate``s for ../shared/peers/bench_packing.py.

A candidate takes (lengths: np.ndarray[int64], max_seq_len: int) and returns packs of indices;
a PackPlan is an iterable of index arrays, so it is returned as is (the harness validates it
outside the timed call).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from thdpack.plan import PackPlan, plan_packs


def plan(lengths, max_seq_len: int) -> PackPlan:
    """The default planner (best-fit decreasing on the length histogram)."""
    return plan_packs(lengths, max_seq_len)


def plan_window(lengths, max_seq_len: int) -> PackPlan:
    """The order-preserving windowed best fit."""
    return plan_packs(lengths, max_seq_len, algorithm="window")


def plan_sequential(lengths, max_seq_len: int) -> PackPlan:
    """Next fit in dataset order (NeMo AutoModel / torchtune packs)."""
    return plan_packs(lengths, max_seq_len, algorithm="sequential")
