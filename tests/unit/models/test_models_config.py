"""ModelConfig: defaults, presets (and their YAML twins), the attention config, every check with its message."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from thdpack.attention import AttentionConfig
from thdpack.models import MODEL_PRESETS, ModelConfig, Transformer

ALL_MODEL_YAMLS = sorted((Path(__file__).resolve().parents[3] / "configs" / "model").glob("*.yaml"))
MODEL_YAMLS = [path for path in ALL_MODEL_YAMLS if path.stem != "hf"]
"""thdpack's decoder presets (hf.yaml is the Hugging Face group: tests/unit/models/test_models_hf_causal_lm.py)."""


def test_defaults_are_the_cpu_training_model():
    config = ModelConfig()
    assert (config.vocab_size, config.dim, config.n_layers, config.n_heads, config.n_kv_heads) == (50257, 128, 2, 4, 2)
    assert config.head_dim == 32
    assert config.attention == AttentionConfig()
    assert ModelConfig.preset("small") == config


def test_tiny_preset_and_overrides():
    tiny = ModelConfig.preset("tiny")
    assert (tiny.vocab_size, tiny.dim, tiny.n_layers, tiny.n_heads, tiny.n_kv_heads, tiny.ffn_dim) == (
        64,
        32,
        2,
        4,
        2,
        64,
    )
    assert ModelConfig.preset("tiny", n_layers=1).n_layers == 1
    assert MODEL_PRESETS == ("tiny", "small", "114m")


def test_the_attention_settings_are_one_attention_config():
    attention = AttentionConfig(backend="math", causal=False, softmax_scale=0.5, cp_comm_type="all_gather")
    config = ModelConfig.preset("tiny", attention=attention)
    assert config.attention is attention
    assert {f.name for f in dataclasses.fields(ModelConfig)}.isdisjoint({"attention_backend", "causal", "cp_comm_type"})


def test_the_old_attention_field_names_still_work_in_preset():
    config = ModelConfig.preset("tiny", attention_backend="math", causal=False, cp_comm_type="all_gather")
    assert config.attention == AttentionConfig(backend="math", causal=False, cp_comm_type="all_gather")
    assert config == ModelConfig.preset("tiny", attention=config.attention)
    with pytest.raises(TypeError, match=r"got both attention and \['causal'\]; set them inside attention="):
        ModelConfig.preset("tiny", attention=AttentionConfig(), causal=False)
    with pytest.raises(ValueError, match=r"unknown attention backend 'fast'; valid: 'auto', 'te'"):
        ModelConfig.preset("tiny", attention_backend="fast")


@pytest.mark.parametrize("path", MODEL_YAMLS, ids=lambda p: p.stem)
def test_every_model_yaml_is_the_preset_of_its_name(path):
    import omegaconf  # the YAML loader Hydra uses

    assert path.stem in MODEL_PRESETS, f"configs/model/{path.name} names no ModelConfig preset"
    fields = omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.load(path))
    assert ModelConfig(**fields) == ModelConfig.preset(path.stem)


def test_every_trainable_preset_has_its_yaml():
    # tiny's 64-token vocabulary cannot hold GPT-2's tokens: a test / verify model, not a training preset
    assert [p.stem for p in MODEL_YAMLS] == sorted(p for p in MODEL_PRESETS if p != "tiny")


@pytest.mark.parametrize(("name", "millions"), [("small", 6.8), ("114m", 114.1)])
def test_parameter_counts_match_the_names_and_docs(name, millions):
    model = Transformer(ModelConfig.preset(name), device="meta")
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == millions


def test_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ModelConfig().dim = 64  # type: ignore[misc]
    with pytest.raises(TypeError):
        ModelConfig(64)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"dim": 0}, ValueError, r"dim must be an int >= 1, got 0"),
        ({"n_layers": 2.0}, ValueError, r"n_layers must be an int >= 1, got 2.0"),
        ({"vocab_size": True}, ValueError, r"vocab_size must be an int >= 1, got True"),
        ({"dim": 30, "n_heads": 4}, ValueError, r"dim=30 is not a multiple of n_heads=4"),
        ({"dim": 12, "n_heads": 4, "n_kv_heads": 2}, ValueError, r"head dim dim // n_heads = 3 is odd"),
        ({"n_heads": 4, "n_kv_heads": 3}, ValueError, r"n_heads=4 is not a multiple of n_kv_heads=3"),
        ({"rope_theta": 0.0}, ValueError, r"rope_theta must be a number > 0, got 0.0"),
        ({"norm_eps": -1e-5}, ValueError, r"norm_eps must be a number > 0"),
        ({"init_std": "0.02"}, ValueError, r"init_std must be a number > 0, got '0.02'"),
        ({"tie_embeddings": 1}, TypeError, r"tie_embeddings must be a bool, got 1"),
        (
            {"attention": {"backend": "math"}},
            TypeError,
            r"attention must be a thdpack.attention.AttentionConfig, got dict; e.g. attention=AttentionConfig\(",
        ),
    ],
)
def test_bad_values_are_rejected_with_the_fix(fields, error, match):
    with pytest.raises(error, match=match):
        ModelConfig(**fields)


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown model preset 'medium'; valid: 'tiny', 'small', '114m'"):
        ModelConfig.preset("medium")  # type: ignore[arg-type]


def test_the_trainer_composes_the_attention_group_into_the_model():
    import hydra
    from omegaconf import OmegaConf

    from thdpack.train.config import Config, register_configs

    register_configs()
    config_dir = str(MODEL_YAMLS[0].parents[1])
    overrides = ["model=114m", "attention=math", "attention.causal=false", "attention.softmax_scale=0.25"]
    with hydra.initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = OmegaConf.to_object(hydra.compose("train", overrides=overrides))
    assert isinstance(cfg, Config)
    want = AttentionConfig(backend="math", causal=False, softmax_scale=0.25)
    assert cfg.model_config() == ModelConfig.preset("114m", attention=want)
    assert cfg.attention_config() == want
    with hydra.initialize_config_dir(config_dir=config_dir, version_base=None):
        default = OmegaConf.to_object(hydra.compose("train"))
    assert default.model_config() == ModelConfig.preset("small")


def test_the_a2a_attention_group_and_a_bad_comm_type_override():
    import hydra
    from omegaconf import OmegaConf

    from thdpack.train.config import register_configs

    register_configs()
    config_dir = str(MODEL_YAMLS[0].parents[1])
    with hydra.initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = OmegaConf.to_object(hydra.compose("train", overrides=["attention=a2a"]))
        assert cfg.attention_config() == AttentionConfig(cp_comm_type="a2a")
        bad = hydra.compose("train", overrides=["attention.cp_comm_type=ulysses"])
    with pytest.raises(ValueError, match=r"unknown cp_comm_type 'ulysses'; valid: 'p2p', 'all_gather', 'a2a'"):
        OmegaConf.to_object(bad)
