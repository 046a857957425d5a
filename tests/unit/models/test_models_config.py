"""ModelConfig: defaults, presets, and every check with its message."""

from __future__ import annotations

import dataclasses

import pytest

from thdpack.models import MODEL_PRESETS, ModelConfig


def test_defaults_are_the_cpu_training_model():
    config = ModelConfig()
    assert (config.vocab_size, config.dim, config.n_layers, config.n_heads, config.n_kv_heads) == (50257, 128, 2, 4, 2)
    assert config.head_dim == 32
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
    assert ModelConfig.preset("tiny", causal=False, attention_backend="math").causal is False
    assert MODEL_PRESETS == ("tiny", "small")


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
        ({"attention_backend": "fast"}, ValueError, r"unknown attention backend 'fast'; valid: 'auto', 'te'"),
        ({"cp_comm_type": "ring"}, ValueError, r"unknown cp_comm_type 'ring'; valid: 'p2p', 'all_gather'"),
        ({"causal": 1}, TypeError, r"causal must be a bool, got 1"),
    ],
)
def test_bad_values_are_rejected_with_the_fix(fields, error, match):
    with pytest.raises(error, match=match):
        ModelConfig(**fields)


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown model preset 'medium'; valid: 'tiny', 'small'"):
        ModelConfig.preset("medium")  # type: ignore[arg-type]
