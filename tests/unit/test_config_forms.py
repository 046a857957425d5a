"""Every plan setting is declared once, in PlanConfig: the flat doors, PackingArguments and the
options of ``thdpack prepare`` / ``stats`` / ``verify`` are generated from its fields, so a setting
added to it appears in each, with its help, default and check."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

import thdpack._config_forms as _config_forms
from thdpack._settings import integer, setting
from thdpack.data import prepare_command, stats_command
from thdpack.plan import PlanConfig, plan_packs
from thdpack.plan.config import LIBRARY_CP_PLACEMENT, TRAINING_CP_PLACEMENT
from thdpack.verify.command import add_verify_arguments


@dataclasses.dataclass(frozen=True, kw_only=True)
class GrownPlanConfig(PlanConfig):
    """PlanConfig with a setting added, as a later change would add one."""

    min_fill: int = setting("Tokens a pack holds at least (a made-up setting).", default=3, check=integer(0))


def _parse(add, argv):
    parser = argparse.ArgumentParser()
    add(parser)
    return parser, parser.parse_args(argv)


def test_a_setting_added_to_the_plan_config_appears_in_every_cli(monkeypatch, capsys):
    monkeypatch.setattr(prepare_command, "PlanConfig", GrownPlanConfig)
    monkeypatch.setattr(stats_command, "PlanConfig", GrownPlanConfig)
    parser, args = _parse(prepare_command.add_prepare_arguments, ["x", "--out", "o", "--pack-size", "64"])
    assert prepare_command.plan_config_of(args) == GrownPlanConfig(pack_size=64, seed=0, cp_placement="adaptive")
    args = parser.parse_args(["x", "--out", "o", "--pack-size", "64", "--min-fill", "9"])
    assert prepare_command.plan_config_of(args).min_fill == 9
    parser.print_help()
    shown = " ".join(capsys.readouterr().out.split())
    assert "--min-fill MIN_FILL Tokens a pack holds at least (a made-up setting). (default: 3)" in shown
    with pytest.raises(ValueError, match="min_fill must be >= 0, got -1"):  # the field's own check
        prepare_command.plan_config_of(parser.parse_args(["x", "--out", "o", "--pack-size", "64", "--min-fill", "-1"]))

    _, args = _parse(stats_command.add_stats_arguments, ["--pack-size", "64", "128", "--min-fill", "5"])
    configs = stats_command.plan_configs(args)
    assert len(configs) == 2 * 4 and {c.min_fill for c in configs} == {5}
    assert {(c.pack_size, c.cp_placement) for c in configs} == {(64, "adaptive"), (128, "adaptive")}


def test_a_setting_added_to_the_plan_config_appears_in_packing_arguments():
    pytest.importorskip("transformers")
    from thdpack.integrations.packing_arguments import packing_arguments

    grown = packing_arguments(GrownPlanConfig)
    assert "min_fill" in {f.name for f in dataclasses.fields(grown)}
    assert grown(min_fill=4).dataset_config(pack_size=64, overflow="error", seed=0).plan == GrownPlanConfig(
        pack_size=64, seed=0, cp_placement=TRAINING_CP_PLACEMENT, min_fill=4
    )
    with pytest.raises(TypeError, match=r"min_fill must be an integer, got 1\.5"):
        grown(min_fill=1.5)


def test_a_setting_added_to_the_plan_config_appears_in_a_flat_door():
    door = _config_forms.FlatKeywords("plan", [_config_forms.Part(GrownPlanConfig)])
    assert door.build(pack_size=64, min_fill=2) == (GrownPlanConfig(pack_size=64, min_fill=2),)
    with pytest.raises(TypeError, match=r"plan\(\) got an unexpected keyword argument 'min_fil'; it takes pack_size, "):
        door.build(pack_size=64, min_fil=2)


def test_plan_packs_takes_every_plan_setting():
    parameters = inspect.signature(plan_packs).parameters
    # beside the settings, the run's values: its CP size and a timed plan's timing
    assert set(parameters) == {"lengths", "cp_size", "timing"} | {f.name for f in dataclasses.fields(PlanConfig)}
    for f in dataclasses.fields(PlanConfig)[1:]:  # pack_size is positional
        assert parameters[f.name].default == f.default and f.name in plan_packs.__doc__
    plan = plan_packs([5, 3, 6, 2, 4], 16, cp_size=2, cp_placement="adaptive", improve=False)
    assert plan.placement is not None
    with pytest.raises(TypeError, match="plan_packs\\(\\) got an unexpected keyword argument 'placement'"):
        plan_packs([5], 16, placement="adaptive")


def test_the_cp_placement_default_follows_one_rule():
    """What trains with thdpack (trainer, PackingArguments, the commands) defaults to adaptive; the
    library's building blocks (PlanConfig, plan_packs, PackedDataset) to TE's layout."""
    from thdpack.packing import PackedDataset
    from thdpack.train.config import Config
    from thdpack.verify.exactness import StepSpread

    assert (LIBRARY_CP_PLACEMENT, TRAINING_CP_PLACEMENT) == ("te", "adaptive")
    assert PlanConfig(pack_size=8).cp_placement == LIBRARY_CP_PLACEMENT
    assert inspect.signature(plan_packs).parameters["cp_placement"].default == LIBRARY_CP_PLACEMENT
    assert inspect.signature(PackedDataset).parameters["cp_placement"].default == LIBRARY_CP_PLACEMENT
    assert StepSpread().cp_placement == LIBRARY_CP_PLACEMENT
    assert Config().packing_config.plan.cp_placement == TRAINING_CP_PLACEMENT
    for add, argv in (
        (prepare_command.add_prepare_arguments, ["x", "--out", "o", "--pack-size", "64"]),
        (stats_command.add_stats_arguments, []),
        (add_verify_arguments, ["--cp-size", "2"]),
    ):
        assert _parse(add, argv)[1].cp_placement == TRAINING_CP_PLACEMENT


def test_the_timed_plan_settings_appear_in_every_form(capsys):
    """cost_model='time' / cp_placement='auto' and their profile / model_shape, declared once in
    PlanConfig: in the commands' options, PackingArguments, the trainer's packing node and plan_packs."""
    parser, args = _parse(
        prepare_command.add_prepare_arguments,
        ["x", "--out", "o", "--pack-size", "64", "--cp-placement", "auto", "--profile", "h100_sxm",
         "--model-shape", "llama3-8b"],
    )  # fmt: skip
    config = prepare_command.plan_config_of(args)
    assert (config.cp_placement, config.profile, config.model_shape) == ("auto", "h100_sxm", "llama3-8b")
    parser.print_help()
    shown = " ".join(capsys.readouterr().out.split())
    assert "--profile PROFILE The machine cost_model='time' and cp_placement='auto' model" in shown
    assert "--model-shape MODEL_SHAPE The model cost_model='time' and cp_placement='auto' time" in shown
    with pytest.raises(ValueError, match="cp_placement='auto' times packs on a machine for a model"):
        prepare_command.plan_config_of(parser.parse_args(["x", "--out", "o", "--pack-size", "64",
                                                          "--cp-placement", "auto"]))  # fmt: skip
    assert {"profile", "model_shape"} <= set(inspect.signature(plan_packs).parameters)
    from thdpack.train.config import Config

    node = Config().packing
    assert (node.profile, node.model_shape, node.cost_model) == (None, None, "tiles")
    pytest.importorskip("transformers")
    from thdpack.integrations.transformers import PackingArguments

    arguments = PackingArguments(cp_placement="auto", profile="h100_sxm", model_shape="llama3-8b")
    plan = arguments.dataset_config(pack_size=64, overflow="error", seed=0).plan
    assert (plan.cp_placement, plan.profile, plan.model_shape) == ("auto", "h100_sxm", "llama3-8b")
    with pytest.raises(ValueError, match="cost_model='time' times packs on a machine for a model"):
        PackingArguments(cost_model="time").dataset_config(pack_size=64, overflow="error", seed=0)
