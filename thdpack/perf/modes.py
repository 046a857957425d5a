"""thdpack's ways to run a lengths file on a ``dp x cp`` mesh, as mesh runs the step model times.

``MODES`` is the closed set: ``te`` (TE's layout), ``adaptive`` (per-sequence placement), ``a2a``
(all-to-all), ``auto`` (each pack the fastest of those, ``thdpack.perf.auto``) and ``mesh``
(``auto`` with ``cp`` = the whole mesh); ``auto`` and ``mesh`` need the ``StepModel`` that times
them. Steps are cut and dealt as thdpack's trainer cuts and deals them
(``thdpack.packing.step_stream``); with ``batch_size``, each global batch is planned on its own,
as Megatron-LM schedules.

Legend: ``P`` packs, ``E`` entries.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np

from thdpack.layout.placement import CpPlacement
from thdpack.perf.mesh import Comm, MeshRun, placed_run
from thdpack.perf.step import StepModel
from thdpack.perf.time_cost import TimeCostModel
from thdpack.plan import plan_packs
from thdpack.plan.auto import plan_auto
from thdpack.plan.config import DEFAULT_WINDOW
from thdpack.plan.overflow import apply_overflow

Mode = Literal["te", "adaptive", "a2a", "auto", "mesh"]
MODES: tuple[Mode, ...] = ("te", "adaptive", "a2a", "auto", "mesh")


class Packs(NamedTuple):
    """Packs and every entry's group (a ``CpPlacement``'s arrays) on ``cp_size`` ranks; ``a2a``:
    (P,) bool, the packs attended by all-to-all (``auto``), or None."""

    offsets: np.ndarray
    lengths: np.ndarray
    group_size: np.ndarray
    group_start: np.ndarray
    cp_size: int
    pack_size: int
    a2a: np.ndarray | None = None


def mesh_shape(mode: Mode, world: int, cp: int) -> tuple[int, int]:
    """``(dp, cp)`` of ``mode`` on ``world`` ranks (``mesh``: one CP group of every rank)."""
    check_mode(mode)
    if mode == "mesh":
        return 1, world
    if world % cp:
        raise ValueError(f"world={world} is not a multiple of cp={cp}; dp x cp must be the mesh")
    return world // cp, cp


def check_mode(mode: str) -> None:
    """``ValueError`` listing the valid modes unless ``mode`` is one."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")


def plan_mode(lengths: np.ndarray, mode: Mode, *, cp: int, pack_size: int, model: StepModel | None = None) -> Packs:
    """The packs of ``mode`` for ``lengths``, as thdpack's planner makes them.

    Args:
        lengths: (S,) sequence lengths; sequences longer than ``pack_size`` are split.
        mode: one of ``MODES``.
        cp: the CP size each pack is laid out for.
        pack_size: tokens per pack.
        model: the ``StepModel`` that times ``auto`` and ``mesh`` (required for them at ``cp > 1``).

    Returns:
        ``Packs``: the packs' offsets and every entry's length and CP group (a ``CpPlacement``'s
        arrays; TE's layout as every entry split over all ``cp`` ranks), and for ``auto`` the packs
        attended by all-to-all.
    """
    check_mode(mode)
    if mode in ("auto", "mesh") and cp > 1:
        if model is None:
            raise ValueError(f"mode {mode!r} chooses each pack's layout by modelled time: pass the StepModel")
        entries = apply_overflow(np.asarray(lengths, dtype=np.int64), pack_size, "split").length
        _, _, placement, a2a, _ = plan_auto(entries, pack_size, cp, timing=TimeCostModel(model), algorithm="bfd",
                                            window=DEFAULT_WINDOW, rng=None)  # fmt: skip
        return Packs(placement.offsets, placement.lengths, placement.group_size, placement.group_start, cp, pack_size,
                     a2a)  # fmt: skip
    if mode == "a2a" or cp == 1:
        plan = plan_packs(lengths, pack_size, overflow="split")
        entries = plan.entry_lengths_flat()
        size = np.full(len(entries), cp, dtype=np.int64)
        return Packs(plan.offsets, entries, size, np.zeros(len(entries), dtype=np.int64), cp, pack_size)
    placement_mode = "te" if mode == "te" else "adaptive"
    plan = plan_packs(lengths, pack_size, cp_size=cp, cp_placement=placement_mode, overflow="split")
    placement = plan.placement
    if placement is None:
        entries = plan.entry_lengths_flat()
        placement = CpPlacement.all_split(plan.offsets, entries, cp_size=cp, pack_size=pack_size)
    return Packs(placement.offsets, placement.lengths, placement.group_size, placement.group_start, cp, pack_size)


def mode_run(
    lengths: np.ndarray,
    mode: Mode,
    *,
    world: int,
    cp: int,
    rank_tokens: int,
    micro_batches: int = 1,
    batch_size: int | None = None,
    split_comm: Comm = "ring",
    seed: int = 0,
    model: StepModel | None = None,
) -> MeshRun:
    """The mesh run of ``mode`` on ``world`` ranks, cut into steps as thdpack's trainer cuts them.

    Args:
        lengths: (S,) sequence lengths.
        mode: one of ``MODES``.
        world: ranks of the mesh (``dp x cp``).
        cp: ranks per CP group (``mesh`` uses all ``world``).
        rank_tokens: tokens per rank: packs hold ``cp x rank_tokens``.
        micro_batches: packs per data-parallel rank and step (rounds).
        batch_size: None: the epoch's packs in a seeded shuffled order, ``dp x micro_batches`` per
            step, dealt by attention cost (``thdpack.packing.dealing.deal``); else each global batch
            of ``batch_size`` sequences planned on its own, as Megatron-LM schedules.
        split_comm: how split sequences exchange K/V (``"ring"`` or ``"allgather"``).
        seed: the pack order's seed.
        model: the ``StepModel`` that times ``auto`` and ``mesh``.

    Returns:
        The ``MeshRun`` of the whole steps (a last partial step is left out).
    """
    dp, cp = mesh_shape(mode, world, cp)
    pack_size = cp * rank_tokens
    comm: Comm = "a2a" if mode == "a2a" else split_comm
    lengths = np.asarray(lengths, dtype=np.int64)
    if batch_size is None:
        packs = plan_mode(lengths, mode, cp=cp, pack_size=pack_size, model=model)
        order = np.random.default_rng(seed).permutation(len(packs.offsets) - 1)
        per_step = dp * micro_batches
        steps = len(order) // per_step
        if steps == 0:
            raise ValueError(
                f"{len(order)} packs do not fill one step of dp x micro_batches = {per_step}; use fewer ranks, "
                "fewer micro-batches or more sequences"
            )
        chosen = [order[s * per_step : (s + 1) * per_step] for s in range(steps)]
        parts = [(packs, chosen)]
    else:
        steps = len(lengths) // batch_size
        if steps == 0:
            raise ValueError(f"{len(lengths)} sequences do not fill one global batch of {batch_size}")
        parts = []
        for s in range(steps):
            chunk = lengths[s * batch_size : (s + 1) * batch_size]
            packs = plan_mode(chunk, mode, cp=cp, pack_size=pack_size, model=model)
            parts.append((packs, [np.arange(len(packs.offsets) - 1)]))
    return _dealt_run(parts, dp=dp, cp=cp, pack_size=pack_size, comm=comm)


def _dealt_run(parts: list[tuple[Packs, list[np.ndarray]]], *, dp: int, cp: int, pack_size: int, comm: Comm) -> MeshRun:
    """One run of every step's packs (``parts``: packs and, per step, the packs it takes), each
    step's packs dealt to the ``dp`` ranks as the trainer deals them."""
    # the dealer lives with the packing code (it imports torch through its package): load it here
    from thdpack.packing.dealing import deal, pack_costs

    offsets, lengths, size, start, steps, rounds, ranks, a2a = [np.zeros(1, np.int64)], [], [], [], [], [], [], []
    step = 0
    for packs, step_packs in parts:
        for chosen in step_packs:
            pieces = [packs.lengths[packs.offsets[p] : packs.offsets[p + 1]] for p in chosen.tolist()]
            costs = np.concatenate((pack_costs(pieces, "attention"), np.zeros(-len(pieces) % dp)))
            for d, hand in enumerate(deal(costs, dp)):
                for m, i in enumerate(j for j in hand if j < len(pieces)):
                    p = int(chosen[i])
                    a, b = packs.offsets[p], packs.offsets[p + 1]
                    lengths.append(packs.lengths[a:b])
                    size.append(packs.group_size[a:b])
                    start.append(packs.group_start[a:b])
                    offsets.append(offsets[-1][-1:] + (b - a))
                    steps.append(step)
                    rounds.append(m)
                    ranks.append(d)
                    a2a.append(packs.a2a is not None and bool(packs.a2a[p]))
            step += 1
    return placed_run(
        offsets=np.concatenate(offsets),
        lengths=np.concatenate(lengths),
        group_size=np.concatenate(size),
        group_start=np.concatenate(start),
        pack_step=np.array(steps),
        pack_round=np.array(rounds),
        pack_dp=np.array(ranks),
        cp_size=cp,
        dp_size=dp,
        pack_size=pack_size,
        split_comm=comm,
        pack_a2a=np.array(a2a, dtype=bool),
    )
