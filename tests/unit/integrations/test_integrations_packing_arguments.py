"""PackingArguments: PlanConfig's and PackedDatasetConfig's settings with their checks and help, the
CP size and the attention settings; transformers' HfArgumentParser reads them. It imports neither
transformers nor TRL."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from thdpack.attention.config import AttentionConfig
from thdpack.integrations.packing_arguments import PackingArguments
from thdpack.packing.dataset import PackedDatasetConfig
from thdpack.plan.config import TRAINING_CP_PLACEMENT, PlanConfig


def test_packing_arguments():
    assert PackingArguments().shuffle_packs and not PackingArguments(algorithm="sequential").shuffle_packs
    assert PackingArguments(algorithm="window", shuffle=True).shuffle_packs
    with pytest.raises(ValueError, match="pack_size must be >= 1, got 0"):
        PackingArguments(pack_size=0)
    with pytest.raises(ValueError, match="unknown overflow policy 'wrap'; valid: error, drop, truncate, split"):
        PackingArguments(overflow="wrap")
    assert PackingArguments().cp_placement == TRAINING_CP_PLACEMENT == "adaptive"
    assert PackingArguments().cost_model == "tiles"
    with pytest.raises(ValueError, match="unknown cp_placement 'ring'; valid: te, adaptive, auto"):
        PackingArguments(cp_placement="ring")
    with pytest.raises(ValueError, match="unknown cost_model 'flops'; valid: tiles, pairs, time"):
        PackingArguments(cost_model="flops")
    with pytest.raises(TypeError, match=r"cp_size must be an integer, got 2\.0"):
        PackingArguments(cp_size=2.0)


@pytest.mark.parametrize("value", [8.5, 8.0, "8", True, 0, 2**41])
def test_a_bad_pack_size_raises_what_the_plan_config_raises(value):
    """The fields are PlanConfig's, with its checks: the same class and message (ValueError before)."""
    with pytest.raises((TypeError, ValueError)) as expected:
        PlanConfig(pack_size=value)
    with pytest.raises(expected.type, match=re.escape(str(expected.value))):
        PackingArguments(pack_size=value)


def test_every_plan_and_dataset_setting_is_a_packing_argument_with_its_help():
    names = {f.name: f for f in dataclasses.fields(PackingArguments)}
    wanted = {f.name for f in dataclasses.fields(PlanConfig)} | {
        f.name for f in dataclasses.fields(PackedDatasetConfig)
    }
    # the seed is the Trainer's data_seed, remainder plays no part in a step stream, plan is listed flat
    assert set(names) == wanted - {"seed", "remainder", "plan"} | {"cp_size", "attention", "resume_data_changed"}
    for f in dataclasses.fields(PlanConfig):
        if f.name != "seed":
            assert names[f.name].metadata["help"].startswith(f.metadata["help"])
    assert PackingArguments(improve=False).dataset_config(pack_size=64, overflow="error", seed=0).plan.improve is False


def test_the_attention_settings_may_be_a_mapping_as_yaml_gives_them():
    """PackingArguments(attention={...}) (YAML, a command line) builds the AttentionConfig, whose
    own checks apply; it failed in the trainer with "replace() should be called on dataclass instances"."""
    assert PackingArguments(attention={"backend": "math", "cp_comm_type": "a2a"}).attention == AttentionConfig(
        backend="math", cp_comm_type="a2a"
    )
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        PackingArguments(attention={"backend": "fast"})
    with pytest.raises(TypeError, match="attention: AttentionConfig has no setting 'kernel'; its settings: backend"):
        PackingArguments(attention={"kernel": "math"})
    with pytest.raises(TypeError, match="attention must be an instance of AttentionConfig or a mapping"):
        PackingArguments(attention="math")


def test_hf_argument_parser_reads_packing_arguments():
    transformers = pytest.importorskip("transformers", reason="HfArgumentParser needs transformers (thdpack[hf])")
    HfArgumentParser = transformers.HfArgumentParser

    parser = HfArgumentParser(PackingArguments)
    (args,) = parser.parse_args_into_dataclasses(["--pack_size", "64", "--cp_placement", "te", "--improve", "false"])
    assert (args.pack_size, args.cp_placement, args.improve) == (64, "te", False)
    (args,) = parser.parse_dict({"pack_size": 64, "attention": {"backend": "math"}})  # a YAML file's dict
    assert args.attention.backend == "math"


@pytest.mark.parametrize("cp_placement", ["te", "adaptive"])
def test_the_plan_config_carries_every_packing_argument(cp_placement):
    packing = PackingArguments(
        algorithm="window", window=7, balance="tokens", cp_placement=cp_placement, cost_model="pairs"
    )
    config = packing.dataset_config(pack_size=64, overflow="split", seed=3)
    assert config.plan.fingerprint() == {
        "pack_size": 64,
        "algorithm": "window",
        "overflow": "split",
        "window": 7,
        "seed": 3,
        "cp_placement": cp_placement,
        "cost_model": "pairs",
        "improve": True,
    }
    assert (config.shuffle, config.balance) == (False, "tokens")


def test_packing_arguments_import_without_transformers():
    code = (
        "import sys; import thdpack.integrations.packing_arguments; "
        "print(sorted(m for m in ('transformers', 'trl', 'accelerate') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
