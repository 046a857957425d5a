"""The step model's prediction of what ``cp_rank_timing.py`` times: each CP rank's attention alone.

``gpu_suite.py``'s ``model_check`` section runs :func:`predict` on the suite's calibrated profile and
compares it with the ``cp_placement`` section's measurement. The same packs (``plan_mode``: the
plan ``thd_bench.planned_packs`` builds) become one mesh run each, one pack per step, and the
step model (``thdpack.perf.step.StepModel.group_times``, one layer of the case's attention heads)
gives every rank's attention work and the host ops of its calls; a rank's time is the longer of
the two on a GPU (the timing synchronises after each pack) and their sum on a CPU. What the
timing leaves out, the model leaves out too: no exchange (the ring's peers are echoed), no
all-to-all (``a2a`` times the kernel on every token for ``Nq / cp`` heads), no linear layers.
Per pack the busiest rank's time and the mean rank's are summed over the packs, as measured.

Legend: ``P`` packs, ``R`` ranks of a CP group, ``Q`` (group, rank) pairs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from thdpack.perf.comm import Topology
from thdpack.perf.host import THDPACK, THDPACK_CPU
from thdpack.perf.machine import MachineProfile
from thdpack.perf.mesh import placed_run
from thdpack.perf.modes import plan_mode
from thdpack.perf.shape import ModelShape
from thdpack.perf.step import StepModel, TrainingSpec

MODE_PLANS = {"te": ("te", "ring"), "adaptive": ("adaptive", "ring"), "a2a": ("te", "a2a"),
              "a2a_adaptive": ("adaptive", "a2a")}  # fmt: skip
"""``cp_rank_timing.MODES`` -> (the plan whose packs it runs, how split sequences run)."""


def rank_seconds(model: StepModel, lengths: np.ndarray, mode: str, *, cp: int, pack_size: int) -> np.ndarray:
    """(P, R) seconds of every rank's attention, forward + backward, one pack at a time."""
    placement, comm = MODE_PLANS[mode]
    packs = plan_mode(lengths, placement, cp=cp, pack_size=pack_size)
    n_packs = len(packs.offsets) - 1
    run = placed_run(offsets=packs.offsets, lengths=packs.lengths, group_size=packs.group_size,
                     group_start=packs.group_start, pack_step=np.arange(n_packs), pack_round=np.zeros(n_packs, int),
                     pack_dp=np.zeros(n_packs, int), cp_size=cp, dp_size=1, pack_size=pack_size,
                     split_comm=comm)  # fmt: skip
    times = model.group_times(run)
    size_G = run.group_size
    pair_group = np.repeat(np.arange(len(size_G)), size_G)
    pair_rank = np.arange(len(pair_group)) - times["pair_start"][pair_group] + run.group_first[pair_group]
    cell = run.group_step[pair_group] * cp + pair_rank
    device = np.bincount(cell, weights=times["attention"], minlength=n_packs * cp)
    host = np.bincount(cell, weights=times["host_ops"], minlength=n_packs * cp) * model.profile.host.op_s
    both = np.maximum(device, host) if model.profile.host.asynchronous else device + host
    return both.reshape(n_packs, cp)


def predict(profile: MachineProfile, case: Any, lengths: np.ndarray) -> list[dict[str, Any]]:
    """One row per CP size and mode, as ``cp_rank_timing.measure`` writes them, modelled."""
    shape = ModelShape(layers=1, hidden=case.heads * case.head_dim, ffn=1, heads=case.heads, kv_heads=case.kv_heads,
                       head_dim=case.head_dim, vocab=1)  # fmt: skip
    stack = THDPACK if profile.host.asynchronous else THDPACK_CPU
    # no exchange (echoed peers), and a2a is its kernel call alone
    timed = dataclasses.replace(stack, exchange=0.0, a2a=stack.attention)
    model = StepModel(profile, shape, Topology.of(profile), TrainingSpec(host=timed))
    rows = []
    for cp in case.cp_sizes:
        per_mode = {mode: rank_seconds(model, lengths, mode, cp=cp, pack_size=case.pack_size) for mode in MODE_PLANS}
        te = 1e3 * float(per_mode["te"].max(axis=1).sum())
        for mode, seconds in per_mode.items():
            busiest = 1e3 * float(seconds.max(axis=1).sum())
            rows.append({"cp_size": cp, "mode": mode, "packs": len(seconds), "busiest_rank_ms": busiest,
                         "mean_rank_ms": 1e3 * float(seconds.mean(axis=1).sum()), "vs_te": busiest / te})  # fmt: skip
    return rows


def compare(measured: list[dict[str, Any]], predicted: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Measured beside modelled, per (cp, mode): busiest-rank ms and the ratio to ``te``."""
    modelled = {(r["cp_size"], r["mode"]): r for r in predicted}
    rows = []
    for m in measured:
        p = modelled[(m["cp_size"], m["mode"])]
        rows.append({
            "cp_size": m["cp_size"], "mode": m["mode"], "measured_ms": m["busiest_rank_ms"],
            "modelled_ms": p["busiest_rank_ms"], "error": p["busiest_rank_ms"] / m["busiest_rank_ms"] - 1,
            "measured_vs_te": m["vs_te"], "modelled_vs_te": p["vs_te"],
        })  # fmt: skip
    return rows


def markdown(entry: dict[str, Any]) -> list[str]:
    """The ``model_check`` section's table."""
    lines = [
        f"Profile {entry['profile']} ({entry['profile_source']}); the step model's busiest CP rank against "
        "cp_placement's, one layer of the case's attention, forward + backward, summed over the packs.",
        "",
        "| cp | mode | measured ms | modelled ms | error | measured vs te | modelled vs te |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in entry["rows"]:
        lines.append(
            f"| {r['cp_size']} | {r['mode']} | {r['measured_ms']:,.2f} | {r['modelled_ms']:,.2f} | "
            f"{100 * r['error']:+.0f}% | {r['measured_vs_te']:.3f} | {r['modelled_vs_te']:.3f} |"
        )
    return lines
