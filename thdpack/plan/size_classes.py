"""The length-class planner: the decreasing fit on the sizes' histogram, then the improvement phase.

``plan_size_classes`` runs the fit (:mod:`thdpack.plan.decreasing_fit`: best or first fit decreasing,
one step per size class) and, unless the fit already reaches the L2 bound, the improvement phase
(:mod:`thdpack.plan.improve`) aiming at the best lower bound (:mod:`thdpack.plan.bounds`); the phase
never adds a pack. ``plan_histogram`` is the same from a dense histogram. ``plan_packs`` and the
adaptive CP planner plan through it; ``materialize`` turns its plan into sequence ids.

>>> hp = plan_histogram(np.bincount([4, 4, 3, 3, 3, 3], minlength=11), capacity=10)
>>> hp.num_packs, hp.fit_packs, hp.pack_contents(0)   # BFD alone: [4,4] [3,3,3] [3]
(2, 3, [(4, 1), (3, 2)])
"""

from __future__ import annotations

from typing import Any

import numpy as np

from thdpack.plan.bounds import best_lower_bound_of_sizes, l2_lower_bound_of_sizes
from thdpack.plan.decreasing_fit import Fit, fit_size_classes
from thdpack.plan.histogram_plan import HistogramPlan
from thdpack.plan.improve import improve as improve_plan


def plan_size_classes(
    sizes: np.ndarray,
    counts: np.ndarray,
    capacity: int,
    *,
    fit: Fit = "bfd",
    rng: np.random.Generator | None = None,
    improve: bool = True,
) -> HistogramPlan:
    """Pack ``counts[i]`` items of size ``sizes[i]`` (slot units) into packs of ``capacity``: memory
    and time follow the number of distinct sizes and of pack groups, whatever ``capacity`` is.

    Args:
        sizes: (K,) integers, strictly increasing, in ``[1, capacity]`` (slot units).
        counts: (K,) integers >= 1: items of each size.
        capacity: pack capacity in slot units (>= 1).
        fit, rng: the decreasing fit's (``thdpack.plan.decreasing_fit.fit_size_classes``).
        improve: run the improvement phase after the fit (``thdpack.plan.improve``) unless the
            fit already reaches the lower bound; it never adds a pack.

    Returns a ``HistogramPlan``; with ``improve=False``, the same packs as item-level BFD / FFD.

    >>> hp = plan_size_classes(np.array([1, 3, 4, 5]), np.array([1, 2, 1, 2]), capacity=10**12)
    >>> hp.num_packs, hp.pack_contents(0)
    (1, [(5, 2), (4, 1), (3, 2), (1, 1)])
    """
    hp = fit_size_classes(sizes, counts, capacity, fit=fit, rng=rng)
    sizes, counts = np.asarray(sizes), np.asarray(counts)
    if not improve or not len(sizes) or hp.num_packs <= l2_lower_bound_of_sizes(sizes, counts, capacity):
        return hp
    return improve_plan(hp, target=best_lower_bound_of_sizes(sizes, counts, capacity))


def plan_histogram(counts: np.ndarray, capacity: int, **options: Any) -> HistogramPlan:
    """``plan_size_classes`` of a dense histogram. A huge ``capacity`` wants ``plan_size_classes``
    itself, which never makes an array of ``capacity + 1``.

    Args:
        counts: (capacity + 1,) int, ``counts[s]`` items of size ``s`` (slot units), ``counts[0] == 0``.
        capacity: the pack's capacity in slot units.
        **options: ``plan_size_classes``'s ``fit``, ``rng`` and ``improve``.

    Returns:
        The plan as pack templates and their counts (``materialize`` gives sequence ids).

    >>> hp = plan_histogram(np.bincount([5, 5, 4, 3, 3, 1], minlength=11), capacity=10)
    >>> sorted(hp.pack_contents(g) for g in range(len(hp.group_node)))
    [[(1, 1)], [(4, 1), (3, 2)], [(5, 2)]]
    """
    counts = np.asarray(counts)
    if counts.ndim != 1 or len(counts) != capacity + 1:
        raise ValueError(f"counts must have shape ({capacity + 1},), got {counts.shape}")
    if counts[0] != 0:
        raise ValueError("counts[0] must be 0: every item occupies at least one slot")
    sizes = np.flatnonzero(counts)
    return plan_size_classes(sizes, counts[sizes], capacity, **options)
