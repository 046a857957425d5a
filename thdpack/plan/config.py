"""PlanConfig: the settings of a packing plan, checked once, in one place.

``plan_packs``' keywords, ``PackedDatasetConfig.plan``, the trainer's ``packing`` group, ``thdpack
prepare``'s arguments and a prepared store's ``manifest.json["plan"]`` are all this one config.
The context-parallel size is not one of its settings: it comes from the run (the process group),
so it is passed beside the config (``plan_with(lengths, config, cp_size=...)``).

>>> PlanConfig(pack_size=2048, algorithm="window").fingerprint()  # doctest: +NORMALIZE_WHITESPACE
{'pack_size': 2048, 'algorithm': 'window', 'overflow': 'error', 'window': 1024, 'seed': None,
 'cp_placement': 'te', 'cost_model': 'tiles', 'improve': True}
>>> PlanConfig(pack_size=2048.0)
Traceback (most recent call last):
...
TypeError: pack_size must be an integer, got 2048.0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from thdpack._settings import Settings, check_choice, check_int
from thdpack.plan.cp_cost import COST_MODELS, CostModel
from thdpack.plan.overflow import OVERFLOWS, Overflow

Algorithm = Literal["bfd", "ffd", "sequential", "window"]
ALGORITHMS: tuple[str, ...] = ("bfd", "ffd", "sequential", "window")
CpPlacementMode = Literal["te", "adaptive"]
CP_PLACEMENTS: tuple[str, ...] = ("te", "adaptive")
TRAINING_CP_PLACEMENT: CpPlacementMode = "adaptive"
"""The default of the trainer (``packing.cp_placement``) and of ``thdpack prepare --cp-placement``:
measured never slower than ``te`` end to end, never more busiest-rank tiles (README, "CP placement:
the default"). ``PlanConfig`` and ``plan_packs`` keep TE's layout, the format other tools expect."""
DEFAULT_WINDOW = 1024
MAX_LENGTH = 2**40
"""The longest sequence (and the largest pack) thdpack plans: a trillion tokens, far inside int64 sums."""


def pack_size_setting(pack_size: object) -> int:
    """``pack_size`` as an ``int`` in [1, MAX_LENGTH] (``TypeError`` / ``ValueError`` otherwise); the
    check of every config that sets a pack size (``PlanConfig``, ``StreamingPackerConfig``)."""
    pack_size = check_int("pack_size", pack_size, 1)
    if pack_size > MAX_LENGTH:
        raise ValueError(f"pack_size={pack_size:,} is over the largest pack thdpack plans ({MAX_LENGTH:,} tokens)")
    return pack_size


@dataclass(frozen=True, kw_only=True)
class PlanConfig(Settings):
    """Which sequences share a pack: the planner and its settings (see ``plan_packs``)."""

    pack_size: int
    """Tokens per pack; a multiple of 2*cp_size under context parallelism."""
    algorithm: Algorithm = "bfd"
    """"bfd" (best-fit decreasing), "ffd", "sequential" (NeMo's order-preserving next fit) or "window"."""
    overflow: Overflow = "error"
    """Sequences longer than pack_size: "error", "drop", "truncate" or "split" (counted in the stats)."""
    window: int = DEFAULT_WINDOW
    """Lookahead of algorithm="window" (sequences it may reorder across); the others ignore it."""
    seed: int | None = None
    """None plans deterministically; an integer reshuffles ties and pairings reproducibly. A dataset
    plans epoch e with a seed derived from (seed, e) (``thdpack.packing.dealing``)."""
    cp_placement: CpPlacementMode = "te"
    """Under context parallelism: "te" (every sequence split over all CP ranks, Transformer Engine's
    layout) or "adaptive" (short sequences whole on one rank, long ones split over a group of ranks,
    chosen per pack: ``thdpack.plan.adaptive``). Ignored when cp_size == 1."""
    cost_model: CostModel = "tiles"
    """What the adaptive placement minimises on each pack's busiest rank: "tiles" (128 x 128 kernel
    tiles) or "pairs" (causal query-key pairs)."""
    improve: bool = True
    """After "bfd" / "ffd": re-pack the packs that are not full with exact fills
    (``thdpack.plan.improve``) unless the fit already reaches the lower bound; never adds a pack.
    "sequential" and "window" keep their order and ignore it."""

    def __post_init__(self) -> None:
        self.normalize("pack_size", pack_size_setting(self.pack_size))
        check_choice("algorithm", self.algorithm, ALGORITHMS)
        check_choice("overflow policy", self.overflow, OVERFLOWS)
        self.normalize("window", check_int("window", self.window, 1))
        if self.seed is not None:
            self.normalize("seed", check_int("seed", self.seed, 0))
        check_choice("cp_placement", self.cp_placement, CP_PLACEMENTS)
        check_choice("cost_model", self.cost_model, COST_MODELS)
        if not isinstance(self.improve, bool):
            raise TypeError(f"improve must be True or False, got {self.improve!r}")
