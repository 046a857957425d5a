"""PackingRuntime: the run's values a packing component is built with, beside its settings.

A config (``PackedDatasetConfig``, ``StreamingPackerConfig``) holds what a user chooses; the run
decides the rest: the context-parallel size, this process's data-parallel rank and the number of
data-parallel ranks (the dp x cp topology), and the tokenizer's pad id. ``PackingRuntime`` holds
those, checked once when it is made; ``from_topology`` reads them from the run's topology (the
trainer's, the Trainer integrations' or ``thdpack verify``'s: any object with ``cp_size``,
``dp_size`` and ``dp_rank``). A timed plan's ``timing`` (its machine and model on the run's
nodes) is a runtime value too: the planner never loads one itself.

>>> PackingRuntime(cp_size=2, dp_rank=1, dp_size=2, pad_id=50256)
PackingRuntime(cp_size=2, dp_rank=1, dp_size=2, pad_id=50256, timing=None)
>>> PackingRuntime(dp_rank=2, dp_size=2)
Traceback (most recent call last):
...
ValueError: dp_rank=2 is not a rank of dp_size=2 data-parallel ranks; it must be in [0, 2)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from thdpack._settings import check_fields, integer, optional, setting
from thdpack.packing.packer import check_pad_id
from thdpack.plan.auto import PlanTiming


def _timing(name: str, value: object) -> PlanTiming:
    """The check of ``timing``: an object with the ``PlanTiming`` methods."""
    methods = ("whole", "split", "call", "host_lead", "choose", "digest")
    missing = [m for m in methods if not callable(getattr(value, m, None))]
    if missing:
        raise TypeError(
            f"{name} must be a timing model (thdpack.perf.time_cost.timing_of(...)), got {type(value).__name__} "
            f"without {', '.join(missing)}"
        )
    return value  # type: ignore[return-value]


class Topology(Protocol):
    """What ``PackingRuntime.from_topology`` reads of the run's dp x cp topology."""

    @property
    def cp_size(self) -> int: ...

    @property
    def dp_size(self) -> int: ...

    @property
    def dp_rank(self) -> int: ...


@dataclass(frozen=True, kw_only=True)
class PackingRuntime:
    """The run's context of a packing component (module docstring)."""

    cp_size: int = setting(
        "Context-parallel ranks; a sequence takes a multiple of 2*cp_size slots.", default=1, check=integer(1)
    )
    dp_rank: int = setting(
        "This process's data-parallel rank: which share of the packs it is dealt.", default=0, check=integer(0)
    )
    dp_size: int = setting("Data-parallel ranks the packs are dealt to.", default=1, check=integer(1))
    pad_id: int = setting(
        "Token id of the padding (label -100 either way): the tokenizer's pad or EOS id.",
        default=0,
        check=lambda name, value: check_pad_id(value),
    )
    timing: PlanTiming | None = setting(
        "The step-time model a timed plan (cost_model='time', cp_placement='auto') is given: "
        "thdpack.perf.time_cost.timing_of(plan_config, gpus_per_node), the run's machine and model.",
        default=None,
        check=optional(_timing),
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.dp_rank >= self.dp_size:
            raise ValueError(
                f"dp_rank={self.dp_rank} is not a rank of dp_size={self.dp_size} data-parallel ranks; "
                f"it must be in [0, {self.dp_size})"
            )

    @classmethod
    def from_topology(cls, topology: Topology, *, pad_id: int = 0, timing: PlanTiming | None = None) -> PackingRuntime:
        """The runtime of this process's place in ``topology`` (its ``cp_size``, ``dp_size``,
        ``dp_rank``), with the tokenizer's ``pad_id`` and a timed plan's ``timing``."""
        return cls(cp_size=topology.cp_size, dp_rank=topology.dp_rank, dp_size=topology.dp_size, pad_id=pad_id,
                   timing=timing)  # fmt: skip
