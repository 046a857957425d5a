"""``PackingArguments``: thdpack's settings for the Trainer integrations (``ThdpackTrainer``,
``thdpack.integrations.trl.SFTTrainer``), generated from ``PlanConfig`` and ``PackedDatasetConfig``
with their help, defaults and checks, plus the CP size and the attention settings.

It imports neither transformers nor TRL: a launcher can build and check its settings (or
``transformers.HfArgumentParser`` read them) before either loads.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from thdpack._config_forms import Part, config_of, from_flat, twin
from thdpack._settings import Check, check_fields, flag, integer, optional, setting
from thdpack.attention.config import AttentionConfig
from thdpack.packing.dataset import PackedDatasetConfig
from thdpack.plan.config import TRAINING_CP_PLACEMENT, PlanConfig
from thdpack.plan.overflow import Overflow

_ORDER_KEEPING = ("sequential", "window")


class _PackingArgumentsMethods:
    """What ``PackingArguments`` does with its fields (which ``packing_arguments`` generates)."""

    plan_config: ClassVar[type[PlanConfig]]
    field_checks: ClassVar[dict[str, Check]]

    def __post_init__(self) -> None:
        check_fields(self, self.field_checks)

    @property
    def shuffle_packs(self) -> bool:
        shuffle = self.shuffle  # type: ignore[attr-defined]
        return self.algorithm not in _ORDER_KEEPING if shuffle is None else shuffle  # type: ignore[attr-defined]

    def dataset_config(self, *, pack_size: int, overflow: Overflow, seed: int) -> PackedDatasetConfig:
        """The settings the trainers plan and deal packs with: these, plus the pack size and
        overflow each trainer resolves and the Trainer's data seed. Its ``plan`` (a ``PlanConfig``)
        is part of the stream state every checkpoint saves, so a resume with other settings is refused.

        >>> PackingArguments(cp_placement="te").dataset_config(pack_size=64, overflow="error", seed=0).plan.cp_placement
        'te'
        """
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        values.update(pack_size=pack_size, overflow=overflow, seed=seed, shuffle=self.shuffle_packs)
        return from_flat(PackedDatasetConfig, {**values, "plan": from_flat(self.plan_config, values)})


_PACKING_ARGUMENTS_DOC = """thdpack's settings for ``ThdpackTrainer`` / ``thdpack.integrations.trl.SFTTrainer``.

Its fields are ``PlanConfig``'s and ``PackedDatasetConfig``'s, generated from them
(``packing_arguments``): the same help, defaults and checks, so a bad value raises what the
config raises.

>>> PackingArguments(pack_size=4096, algorithm="window").shuffle_packs
False
>>> PackingArguments(algorithm="first_fit")
Traceback (most recent call last):
...
ValueError: unknown algorithm 'first_fit'; valid: bfd, ffd, sequential, window
>>> PackingArguments(pack_size=8.5)
Traceback (most recent call last):
...
TypeError: pack_size must be an integer, got 8.5
>>> PackingArguments(attention={"backend": "math"}).attention
AttentionConfig(backend='math', causal=True, softmax_scale=None, cp_comm_type='p2p')
"""


def packing_arguments(plan_config: type[PlanConfig] = PlanConfig) -> type:
    """The ``PackingArguments`` dataclass: every field of ``plan_config`` and of ``PackedDatasetConfig``
    (their help, checks and defaults; ``cp_placement``'s the training default) but the seed (the
    Trainer's ``data_seed`` / ``seed``) and ``remainder`` (the step stream needs none), plus the CP
    size, the attention settings and whether a resume may change the data."""
    return twin(
        [Part(plan_config), Part(PackedDatasetConfig)],
        name="PackingArguments",
        module=__name__,
        exclude=("seed", "plan", "remainder"),
        defaults={"pack_size": None, "overflow": None, "shuffle": None, "cp_placement": TRAINING_CP_PLACEMENT},
        notes={
            "pack_size": "None: SFTConfig.max_length (TRL); ThdpackTrainer needs one.",
            "overflow": "None: 'error' (ThdpackTrainer); TRL: 'split' for packing_strategy='bfd_split', else "
            "'truncate'.",
            "shuffle": "None: yes, except for 'window' / 'sequential', which keep the dataset's order.",
            "cp_placement": "The default is thdpack's trainer's, 'adaptive'.",
        },
        extra=[
            (
                "cp_size",
                int | None,
                setting(
                    "Context-parallel size. None: accelerate's ParallelismConfig.cp_size (1 without one); when "
                    "both are set they must agree.",
                    default=None,
                    check=optional(integer(1)),
                ),
            ),
            (
                "resume_data_changed",
                bool,
                setting(
                    "Resume from a checkpoint trained on other data (another train_dataset, or the same number of "
                    "other examples): its model, optimizer and schedule continue, and the pack stream starts at "
                    "this data's beginning. Without it such a resume is refused.",
                    default=False,
                    check=flag,
                ),
            ),
            (
                "attention",
                AttentionConfig,
                setting(
                    "Backend and CP exchange of thdpack's attention: an AttentionConfig or a mapping of its "
                    "settings (as YAML or a command line gives it).",
                    default_factory=AttentionConfig,
                    check=config_of(AttentionConfig),
                ),
            ),
        ],
        frozen=True,
        bases=(_PackingArgumentsMethods,),
        namespace={"plan_config": plan_config},
        doc=_PACKING_ARGUMENTS_DOC,
    )


PackingArguments = packing_arguments()
