"""PlanConfig: the settings of a packing plan, each declared once, with its help and its check.

``plan_packs``' keywords, ``PackedDatasetConfig.plan``, the trainer's ``packing`` group,
``PackingArguments``, the commands' plan options and a prepared store's ``manifest.json["plan"]``
are all generated from its fields (``thdpack._config_forms``). The CP size comes from the run,
so it travels beside the config (``plan_with(lengths, config, cp_size=...)``). The default
``cp_placement`` follows one rule: what trains defaults to ``TRAINING_CP_PLACEMENT``, the library
that plans for other tools to ``LIBRARY_CP_PLACEMENT``.

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
from typing import Any, Literal

from thdpack._settings import Settings, check_int, flag, integer, one_of, optional, setting, text
from thdpack.plan.cp_cost import COST_MODELS, CostModel
from thdpack.plan.overflow import OVERFLOWS, Overflow

Algorithm = Literal["bfd", "ffd", "sequential", "window"]
ALGORITHMS: tuple[str, ...] = ("bfd", "ffd", "sequential", "window")
CpPlacementMode = Literal["te", "adaptive", "auto"]
CP_PLACEMENTS: tuple[str, ...] = ("te", "adaptive", "auto")

LIBRARY_CP_PLACEMENT: CpPlacementMode = "te"
"""The default of the library API that plans for other tools (``PlanConfig``, ``plan_packs``,
``PackedDataset``): Transformer Engine's layout, what TE's ``thd_get_partitioned_indices`` and
NeMo AutoModel read (``plan_packs``' contract)."""
TRAINING_CP_PLACEMENT: CpPlacementMode = "adaptive"
"""The default of what trains with thdpack: the trainer (``packing.cp_placement``), the Trainer
integrations (``PackingArguments``), ``thdpack prepare`` / ``stats`` / ``verify``: measured never
slower than ``te`` end to end, never more busiest-rank tiles (docs/guides/context-parallel.md, "The default")."""
DEFAULT_WINDOW = 1024
MAX_LENGTH = 2**40
"""The longest sequence (and the largest pack) thdpack plans: a trillion tokens, far inside int64 sums."""


def check_pack_size_setting(name: str, pack_size: object) -> int:
    """``pack_size`` as an ``int`` in [1, MAX_LENGTH] (``TypeError`` / ``ValueError`` otherwise); the
    check of every config that sets a pack size (``PlanConfig``, ``StreamingPackerConfig``)."""
    pack_size = check_int(name, pack_size, 1)
    if pack_size > MAX_LENGTH:
        raise ValueError(f"{name}={pack_size:,} is over the largest pack thdpack plans ({MAX_LENGTH:,} tokens)")
    return pack_size


@dataclass(frozen=True, kw_only=True)
class PlanConfig(Settings):
    """Which sequences share a pack: the planner and its settings (see ``plan_packs``)."""

    pack_size: int = setting(
        "Tokens per pack; a multiple of 2*cp_size under context parallelism.", check=check_pack_size_setting
    )
    algorithm: Algorithm = setting(
        "'bfd' (best-fit decreasing: within 0.01% of the optimum on real length mixes), 'ffd' (first-fit "
        "decreasing), 'sequential' (order-preserving next fit: NeMo AutoModel's and torchtune's packs "
        "exactly) or 'window' (keeps the dataset's order up to a bounded window, packs almost as tightly as "
        "bfd). Packs of bfd / ffd come largest sequences first: shuffle them when sampling.",
        default="bfd",
        check=one_of(ALGORITHMS),
    )
    overflow: Overflow = setting(
        "Sequences longer than pack_size: 'error' (raise, naming the first), 'drop', 'truncate' (keep the "
        "first pack_size tokens) or 'split' (cut into pack_size pieces); what each removes or cuts is "
        "counted in the plan's stats.",
        default="error",
        check=one_of(OVERFLOWS, "overflow policy"),
    )
    window: int = setting(
        "Lookahead of algorithm='window' (sequences it may reorder across); the others ignore it.",
        default=DEFAULT_WINDOW,
        check=integer(1),
    )
    seed: int | None = setting(
        "None plans deterministically; an integer reshuffles which equal-length sequences pair up (and "
        "bfd's ties between equally full packs) reproducibly. A dataset plans epoch e with a seed "
        "derived from (seed, e).",
        default=None,
        check=optional(integer(0)),
    )
    cp_placement: CpPlacementMode = setting(
        "Under context parallelism: 'te' (every sequence split over all CP ranks, Transformer Engine's "
        "layout), 'adaptive' (short sequences whole on one rank, long ones split over an aligned group "
        "of ranks, chosen per pack; the plan carries the placement) or 'auto' (the adaptive packs, each "
        "laid out adaptive, as TE's layout or attended by all-to-all, whichever the step-time model of "
        "profile and model_shape says is fastest). Ignored when cp_size == 1.",
        default=LIBRARY_CP_PLACEMENT,
        check=one_of(CP_PLACEMENTS),
    )
    cost_model: CostModel = setting(
        "What the adaptive placement minimises on each pack's busiest CP rank: 'tiles' (128 x 128 kernel "
        "tiles), 'pairs' (causal query-key pairs) or 'time' (modelled nanoseconds of profile and "
        "model_shape, communication included; groups inside one node preferred).",
        default="tiles",
        check=one_of(COST_MODELS),
    )
    profile: str | None = setting(
        "The machine cost_model='time' and cp_placement='auto' model: a shipped profile (h100_sxm, "
        "h200_sxm, a100_sxm_80gb, gb200_nvl72, cpu_gloo) or a profile JSON path (thdpack calibrate "
        "writes one). A dataset's fingerprint holds its content's digest.",
        default=None,
        check=optional(text),
    )
    model_shape: str | None = setting(
        "The model cost_model='time' and cp_placement='auto' time: a named shape (llama3-8b, "
        "megatron-dcp-gpt), a thdpack preset (tiny, small, 114m) or a config.json path (Hugging Face "
        "or ModelShape fields).",
        default=None,
        check=optional(text),
    )
    improve: bool = setting(
        "After 'bfd' / 'ffd': re-pack the packs that are not full with exact fills unless the fit already "
        "reaches the lower bound; never adds a pack. 'sequential' and 'window' keep their order and ignore it.",
        default=True,
        check=flag,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        timed = [f"{name}={value!r}" for name, value in (("cost_model", self.cost_model),
                 ("cp_placement", self.cp_placement)) if value in ("time", "auto")]  # fmt: skip
        missing = [name for name in ("profile", "model_shape") if getattr(self, name) is None]
        if timed and missing:
            raise ValueError(
                f"{' and '.join(timed)} times packs on a machine for a model, but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set; set profile (e.g. 'h100_sxm' or a profile JSON) "
                "and model_shape (e.g. 'llama3-8b' or a config.json)"
            )

    @property
    def timed(self) -> bool:
        """True when the plan times packs (``cost_model='time'`` or ``cp_placement='auto'``)."""
        return self.cost_model == "time" or self.cp_placement == "auto"

    def fingerprint(self) -> dict[str, Any]:
        """The settings the plan depends on, as plain values: ``profile`` and ``model_shape`` only in
        a timed plan (its holder adds the digest of what they hold: ``PlanTiming.digest``)."""
        out = super().fingerprint()
        if not self.timed:
            del out["profile"], out["model_shape"]
        return out
