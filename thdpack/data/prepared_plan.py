"""A prepared store's packing plan: ``thdpack prepare`` writes it, the trainer uses it when it fits.

``thdpack prepare`` plans epoch 0 exactly as the trainer's dataset plans it and records it in
``manifest.json``::

    "plan": {"file": "plan.npz", "config": {pack_size, algorithm, overflow, window, seed},
             "cp_size": C, "checksum": {"size": bytes, "sha256": hex}, "stats": {...}}

:func:`read_prepared_plan` compares a run's settings with the record: when all match the run
trains epoch 0 on the checked file; when one differs it says which and plans epoch 0 itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from thdpack.data.manifest import MANIFEST_FILE, StoreError, read_manifest, write_manifest
from thdpack.files.publish import digest_problem, file_digest
from thdpack.packing.dealing import plan_epoch
from thdpack.plan.auto import PlanTiming
from thdpack.plan.config import PlanConfig
from thdpack.plan.packplan import PackPlan

PLAN_FILE = "plan.npz"
"""The packing plan ``thdpack prepare`` writes beside the store (removed when a store is rewritten)."""


def write_prepared_plan(
    folder: Path, lengths: np.ndarray, config: PlanConfig, *, cp_size: int, timing: PlanTiming | None = None
) -> PackPlan:
    """Plan epoch 0 of ``lengths`` as the trainer will (a timed plan with ``timing``), save it in
    ``folder`` and record it in the store's manifest (rewritten atomically); returns the plan."""
    plan = plan_epoch(lengths, config, cp_size=cp_size, epoch=0, timing=timing)
    plan.save(folder / PLAN_FILE)
    manifest = read_manifest(folder)
    manifest["plan"] = {
        "file": PLAN_FILE,
        "config": _settings(config, timing),
        "cp_size": cp_size,
        "checksum": file_digest(folder / PLAN_FILE),
        "stats": plan.stats.to_dict(),
    }
    write_manifest(folder, manifest)
    return plan


@dataclass(frozen=True)
class PreparedPlan:
    """What the trainer makes of a store's plan."""

    plan: PackPlan | None
    """Epoch 0's plan when the store's settings are the run's, else None (the run plans)."""
    note: str
    """What happened, for the run's log: used, or which settings differ."""


def read_prepared_plan(
    folder: Path, manifest: dict[str, Any], config: PlanConfig, *, cp_size: int, timing: PlanTiming | None = None
) -> PreparedPlan:
    """The store's plan when it was made with ``config``, ``cp_size`` (and a timed plan's ``timing``),
    checked against its checksum."""
    record = manifest.get("plan")
    if not isinstance(record, dict) or not {"config", "cp_size", "checksum"} <= record.keys():
        why = "holds no plan" if record is None else "records a plan without its settings and checksum (older thdpack)"
        return PreparedPlan(None, f"{folder} {why}: the run plans epoch 0")
    stored = {**record["config"], "cp_size": record["cp_size"]}
    mine = {**_settings(config, timing), "cp_size": cp_size}
    differ = [
        f"{key}: store {stored.get(key)!r}, run {value!r}" for key, value in mine.items() if stored.get(key) != value
    ]
    if differ:
        return PreparedPlan(
            None, f"{folder / PLAN_FILE} was planned with other settings ({'; '.join(differ)}): the run plans epoch 0"
        )
    file = folder / record["file"]
    problem = digest_problem(record["checksum"], file_digest(file), MANIFEST_FILE)
    if problem is not None:
        raise StoreError(file, problem)
    return PreparedPlan(
        PackPlan.load(file), f"epoch 0 trains on {file} (planned by `thdpack prepare` with these settings)"
    )


def _settings(config: PlanConfig, timing: PlanTiming | None) -> dict[str, Any]:
    """What the plan depends on: the config's fingerprint, and a timed plan's timing digest."""
    out = config.fingerprint()
    if config.timed and timing is not None:
        out["timing_sha256"] = timing.digest()
    return out
