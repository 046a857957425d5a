"""``cp_placement="auto"``: each pack attended the fastest of three exact ways, by the step-time model.

The ways are the pack's placement (``adaptive``), Transformer Engine's layout (``te``, where the
pack's TE slots fit it) and all-to-all (``a2a``, where the CP size divides the query heads). Each
pack is timed alone as one data-parallel rank's step (``StepTimes.slowest``), so by the model no
pack of an ``auto`` plan is slower than under any of the three; ties keep that order.
docs/design/step_model.md ("What the planner sees") says how the packs themselves are planned.

Legend: ``P`` packs, ``E`` entries, ``C`` candidates.
"""

from __future__ import annotations

import numpy as np

from thdpack.layout.placement import CpPlacement
from thdpack.layout.rules import round_up_to_cp
from thdpack.perf.mesh import Comm, placed_run
from thdpack.perf.step import StepModel

LAYOUTS: tuple[str, ...] = ("adaptive", "te", "a2a")
"""The candidates, in the order ties are broken."""


def pack_seconds(placement: CpPlacement, model: StepModel, comm: Comm = "ring") -> np.ndarray:
    """(P,) modelled seconds of each pack of ``placement`` run alone (its slowest rank: linear,
    attention, exposed communication, host), split sequences exchanging K/V by ``comm`` (``"a2a"``:
    the whole pack by all-to-all)."""
    packs = len(placement)
    run = placed_run(
        offsets=placement.offsets, lengths=placement.lengths, group_size=placement.group_size,
        group_start=placement.group_start, pack_step=np.arange(packs), pack_round=np.zeros(packs, np.int64),
        pack_dp=np.zeros(packs, np.int64), cp_size=placement.cp_size, dp_size=1, pack_size=placement.pack_size,
        split_comm=comm,
    )  # fmt: skip
    return model.run(run).slowest


def all_split(placement: CpPlacement) -> CpPlacement:
    """``placement`` with every entry split over all CP ranks (TE's layout of its packs)."""
    return CpPlacement(
        cp_size=placement.cp_size, pack_size=placement.pack_size, offsets=placement.offsets,
        lengths=placement.lengths, group_size=np.full(len(placement.lengths), placement.cp_size, np.int64),
        group_start=np.zeros(len(placement.lengths), np.int64),
    )  # fmt: skip


def candidate_seconds(placement: CpPlacement, model: StepModel) -> np.ndarray:
    """(C, P) modelled seconds of each pack under each of ``LAYOUTS`` (inf where one cannot run)."""
    packs, cp = len(placement), placement.cp_size
    te_slots_P = np.add.reduceat(round_up_to_cp(placement.lengths, cp), placement.offsets[:-1]) if packs else []
    te_fits_P = np.asarray(te_slots_P) <= placement.pack_size
    seconds = np.full((len(LAYOUTS), packs), np.inf)
    seconds[0] = pack_seconds(placement, model)
    seconds[1, te_fits_P] = pack_seconds(all_split(placement), model)[te_fits_P]
    if model.shape.heads % cp == 0:
        seconds[2] = pack_seconds(placement, model, "a2a")
    return seconds


def choose_layouts(placement: CpPlacement, model: StepModel) -> tuple[CpPlacement, np.ndarray, float]:
    """Per pack the fastest of ``LAYOUTS``: ``(placement, a2a_P, seconds)``, the packs that take
    TE's layout split over all ranks, (P,) bool the packs attended by all-to-all (their layout
    kept), and the modelled seconds of all the packs."""
    seconds_CP = candidate_seconds(placement, model)
    choice_P = np.argmin(seconds_CP, axis=0)
    te_E = np.repeat(choice_P == LAYOUTS.index("te"), np.diff(placement.offsets))
    chosen = CpPlacement(
        cp_size=placement.cp_size, pack_size=placement.pack_size, offsets=placement.offsets,
        lengths=placement.lengths, group_size=np.where(te_E, placement.cp_size, placement.group_size),
        group_start=np.where(te_E, 0, placement.group_start),
    )  # fmt: skip
    return chosen, choice_P == LAYOUTS.index("a2a"), float(seconds_CP.min(axis=0).sum())
