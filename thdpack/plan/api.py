"""plan_packs: choose which sequences share each pack (numpy only, no torch import).

>>> plan = plan_packs([5, 3, 6, 2, 4], pack_size=10)          # best-fit decreasing
>>> [p.tolist() for p in plan]
[[2, 4], [0, 1, 3]]
>>> [p.tolist() for p in plan_packs([5, 3, 6, 2, 4], 10, algorithm="sequential")]
[[0, 1], [2, 3], [4]]
>>> plan = plan_packs([5, 3, 6, 2, 4], 16, cp_size=2)          # each sequence takes a multiple of 4 slots
>>> [p.tolist() for p in plan], plan.stats.cp_padding_tokens
([[0, 2], [1, 3, 4]], 8)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from thdpack._config_forms import FlatKeywords, Part
from thdpack.layout.rules import check_cp_size, check_pack_size, cp_multiple
from thdpack.plan.adaptive import plan_entries
from thdpack.plan.assignment import materialize
from thdpack.plan.auto import PlanTiming, plan_auto
from thdpack.plan.config import MAX_LENGTH, PlanConfig
from thdpack.plan.decreasing_fit import distinct_sizes
from thdpack.plan.ordered import next_fit, window_best_fit
from thdpack.plan.overflow import OVERFLOW_COUNTS, Entries, apply_overflow
from thdpack.plan.packing_stats import PackingStats, build_stats
from thdpack.plan.packplan import PackPlan
from thdpack.plan.size_classes import plan_size_classes


def as_lengths(lengths: object) -> np.ndarray:
    """Validate sequence lengths: a non-empty 1-D array of integers >= 1, as int64."""
    array = np.asarray(lengths)
    if array.dtype == np.bool_:
        raise TypeError("lengths must be integers, got booleans")
    if array.ndim != 1:
        raise ValueError(f"lengths must be 1-D (one length per sequence), got shape {array.shape}")
    if array.size == 0:
        raise ValueError("lengths is empty: there is nothing to pack")
    if array.dtype.kind == "f":
        bad = ~np.isfinite(array) | (array != np.round(array))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"sequence {i} has non-integer length {float(array[i])}; lengths count tokens")
    elif array.dtype.kind not in "iu":
        raise TypeError(f"lengths must be integers, got dtype {array.dtype}")
    # compare before converting: an out-of-range value would wrap to a negative int64 and be misreported
    huge = array > MAX_LENGTH
    if huge.any():
        i = int(np.argmax(huge))
        shown = f"{array[i]:g}" if array.dtype.kind == "f" else str(array[i])
        raise ValueError(f"sequence {i} has length {shown}, over the largest length thdpack plans ({MAX_LENGTH:,})")
    array = array.astype(np.int64, copy=False)
    low = array < 1
    if low.any():
        i = int(np.argmax(low))
        raise ValueError(
            f"sequence {i} has length {int(array[i])}; every sequence needs at least 1 token "
            "(filter out empty sequences before planning, and count them)"
        )
    return array


PLAN_KEYWORDS = FlatKeywords("plan_packs", [Part(PlanConfig)])
"""``plan_packs``' keywords: every field of ``PlanConfig``."""


@PLAN_KEYWORDS.document
def plan_packs(
    lengths: object, pack_size: int, *, cp_size: int = 1, timing: PlanTiming | None = None, **settings: Any
) -> PackPlan:
    """Plan packs of ``pack_size`` tokens for sequences of the given lengths: ``plan_with`` with
    the settings by keyword (every field of ``PlanConfig``, below) and ``timing`` beside them.

    Args:
        lengths: 1-D integers >= 1, one per sequence (list, numpy or CPU torch).
        pack_size: tokens per pack; a multiple of ``2*cp_size`` under context parallelism.
        cp_size: the context-parallel size; each sequence occupies its length rounded up to a
            multiple of ``2*cp_size`` (Transformer Engine's THD sharding needs that).
        timing: the step-time model of a timed plan (``plan_with``).
        **settings: ``PlanConfig``'s fields by name.

    Returns:
        A ``PackPlan``: ``plan[i]`` the sequence indices of pack ``i``, ``plan.stats`` its
        ``PackingStats``, ``plan.placement`` the ``CpPlacement`` under ``cp_placement="adaptive"``.
    """
    (config,) = PLAN_KEYWORDS.build(pack_size=pack_size, **settings)
    return plan_with(lengths, config, cp_size=cp_size, timing=timing)


def plan_with(lengths: object, config: PlanConfig, *, cp_size: int = 1, timing: PlanTiming | None = None) -> PackPlan:
    """``plan_packs`` with its settings in a ``PlanConfig`` and the run's context-parallel size beside it.

    Args:
        lengths: 1-D integers >= 1, one per sequence.
        config: the plan's settings (checked when it was made).
        cp_size: the run's context-parallel size.
        timing: for a timed plan (``cost_model="time"``, ``cp_placement="auto"``), the step-time
            model of the config's profile and model shape on the run's nodes,
            ``thdpack.perf.time_cost.timing_of(config, gpus_per_node)``: the planner does not load
            machines (the trainer, the Trainer integrations and the commands do).

    Returns:
        The ``PackPlan`` (as ``plan_packs``).

    >>> plan = plan_with([5, 3, 6, 2, 4], PlanConfig(pack_size=16), cp_size=2)
    >>> [p.tolist() for p in plan], plan.cp_size
    ([[0, 2], [1, 3, 4]], 2)
    """
    lengths = as_lengths(lengths)
    cp_size = check_cp_size(cp_size)
    check_pack_size(config.pack_size, cp_size)
    pack_size, algorithm, seed = config.pack_size, config.algorithm, config.seed
    cp_placement, cost_model = config.cp_placement, config.cost_model
    multiple = cp_multiple(cp_size)

    entries = apply_overflow(lengths, pack_size, config.overflow)
    if len(entries.length) == 0:
        raise ValueError(
            f"overflow='drop' dropped all {len(lengths)} sequences (each is longer than "
            f"pack_size={pack_size}); nothing is left to pack: use a larger pack_size or overflow='split'"
        )
    units = entries.length if multiple == 1 else -(-entries.length // multiple)  # slots, in `multiple`s
    capacity = pack_size // multiple
    rng = None if seed is None else np.random.default_rng(seed)

    pack_loads = None  # (values, weights) of per-pack real tokens when cheaper than per item
    fit_packs = None  # the decreasing fit's packs when the improvement phase saved some
    distinct = None  # (sizes, counts) of the slots, when the planner already counted them
    if config.timed and cp_size > 1 and timing is None:
        raise ValueError(
            f"cost_model={cost_model!r}, cp_placement={cp_placement!r} times packs, but no timing was given; pass "
            f"timing=thdpack.perf.time_cost.timing_of(config, gpus_per_node) (the model of profile={config.profile!r} "
            f"and model_shape={config.model_shape!r})"
        )
    placement = a2a_packs = None
    if cp_placement == "auto" and cp_size > 1:
        ids, offsets, placement, a2a_packs, cost_model = plan_auto(
            entries.length, pack_size, cp_size, timing=timing, algorithm=algorithm, window=config.window, rng=rng,
            improve=config.improve,
        )  # fmt: skip
    elif cp_placement == "adaptive" and cp_size > 1:
        ids, offsets, placement = plan_entries(
            entries.length,
            pack_size,
            cp_size,
            algorithm=algorithm,
            window=config.window,
            rng=rng,
            cost_model=timing if cost_model == "time" else cost_model,
            improve=config.improve,
        )
    elif algorithm == "sequential":
        offsets = next_fit(units, capacity)
        ids = np.arange(len(units), dtype=np.int64)
    elif algorithm == "window":
        ids, offsets = window_best_fit(units, capacity, config.window)
    else:
        # the engine works on the distinct sizes (memory and time follow them and the
        # sequences, whatever pack_size is)
        distinct = distinct_sizes(units)
        hp = plan_size_classes(*distinct, capacity, fit=algorithm, rng=rng, improve=config.improve)
        fit_packs = hp.fit_packs
        ids, offsets = materialize(hp, units, rng=rng)
        if multiple == 1 and not entries.cut:
            pack_loads = (hp.node_load()[hp.group_node], hp.group_count)

    if placement is not None:  # slots in tokens: whole entries take their length, split ones a 2g multiple
        stats = _stats(
            len(lengths), entries, distinct_sizes(placement.slots()), ids, offsets, None, algorithm, pack_size, 1, None
        )
        stats = dataclasses.replace(stats, cp_size=cp_size)
    else:
        if distinct is None:
            distinct = distinct_sizes(units)
        stats = _stats(
            len(lengths), entries, distinct, ids, offsets, pack_loads, algorithm, pack_size, cp_size, fit_packs
        )
    cut = entries.cut
    return PackPlan(
        ids if entries.sequence is None else entries.sequence[ids],
        offsets,
        sequence_lengths=lengths,
        pack_size=pack_size,
        cp_size=cp_size,
        algorithm=algorithm,
        seed=seed,
        stats=stats,
        entry_starts=entries.start[ids] if cut else None,
        entry_lengths=entries.length[ids] if cut else None,
        placement=placement,
        cost_model=cost_model if placement is not None else None,
        a2a_packs=a2a_packs,
    )


def _stats(
    num_inputs: int,
    entries: Entries,
    distinct: tuple[np.ndarray, np.ndarray],
    ids: np.ndarray,
    offsets: np.ndarray,
    pack_loads: tuple[np.ndarray, np.ndarray] | None,
    algorithm: str,
    pack_size: int,
    cp_size: int,
    fit_packs: int | None,
) -> PackingStats:
    num_packs = len(offsets) - 1
    if pack_loads is None:
        per_pack = np.add.reduceat(entries.length[ids], offsets[:-1]) if len(ids) else np.zeros(0)
        pack_loads = (per_pack, np.ones(len(per_pack), dtype=np.int64))
    return build_stats(
        algorithm=algorithm,
        pack_size=pack_size,
        cp_size=cp_size,
        num_packs=num_packs,
        num_sequences=num_inputs - entries.dropped_sequences,
        num_entries=len(entries.length),
        real_tokens=int(entries.length.sum()),
        slot_sizes=distinct[0],
        slot_counts=distinct[1],
        pack_loads=pack_loads,
        max_sequences_per_pack=int(np.diff(offsets).max()) if num_packs else 0,
        overflow={key: getattr(entries, key) for key in OVERFLOW_COUNTS},
        fit_packs=fit_packs,
    )
