"""The trainer's model: a vocabulary smaller than the tokenizer's is refused before building."""

from __future__ import annotations

import pytest

from thdpack.train.config import Config, ModelNode
from thdpack.train.model_setup import build_model, model_vocab_size


@pytest.mark.parametrize("model", [ModelNode(vocab_size=100), ModelNode(kind="hf", vocab_size=100)])
def test_a_vocabulary_smaller_than_the_tokenizers_is_refused_before_building(model):
    cfg = Config(model=model)
    assert model_vocab_size(cfg.model_config()) == 100
    with pytest.raises(ValueError, match=r"the model's vocabulary \(100\) is smaller than the tokenizer's \(50257\); "):
        build_model(cfg, runtime=None, vocab_size=50257)  # refused before the runtime is needed
