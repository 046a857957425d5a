"""Model shapes from Hugging Face configs, ModelShape JSON and names: sizes taken as the models take
them, and every size that cannot be a model's named."""

from __future__ import annotations

import json

import pytest

from thdpack.perf.shape import NAMED_SHAPES, ModelShape, load_shape

LLAMA = {
    "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256,
}  # fmt: skip


def test_a_llama_config_is_the_named_shape():
    assert ModelShape.from_hf_config(LLAMA) == NAMED_SHAPES["llama3-8b"]


def test_a_given_head_dim_is_taken_as_it_is():
    shape = ModelShape.from_hf_config({**LLAMA, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 96})
    assert (shape.heads, shape.head_dim) == (3, 96)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_attention_heads": 3, "num_key_value_heads": 1}, "hidden_size 4096 is not a multiple of num_attention_heads 3"),
        ({"num_attention_heads": 0}, "num_attention_heads must be an int >= 1, got 0"),
        ({"hidden_size": 4096.5}, "hidden_size must be an int >= 1, got 4096.5"),
        ({"vocab_size": None}, "config.json has none of vocab_size"),
        ({"num_key_value_heads": 5}, "ModelShape.heads=32 is not a multiple of kv_heads=5"),
        ({"num_hidden_layers": -2}, "ModelShape.layers must be an int >= 1, got -2"),
    ],
)
def test_a_config_that_cannot_be_a_model_is_named(change, message):
    with pytest.raises(ValueError, match=message):
        ModelShape.from_hf_config({**LLAMA, **change})


def test_load_shape_reads_files_and_names(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert load_shape(tmp_path / "config.json") == NAMED_SHAPES["llama3-8b"]
    (tmp_path / "own.json").write_text(json.dumps({"layers": 2, "hidden": 8, "ffn": 8, "heads": 2, "kv_heads": 1,
                                                   "head_dim": 4, "vocab": 10, "color": "red"}))  # fmt: skip
    with pytest.raises(ValueError, match="unknown ModelShape field 'color'"):
        load_shape(tmp_path / "own.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ValueError, match="holds a list, not a JSON object"):
        load_shape(tmp_path / "list.json")
    with pytest.raises(ValueError, match="unknown model 'gpt-5'"):
        load_shape("gpt-5")
