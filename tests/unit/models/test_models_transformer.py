"""Transformer: deterministic weights, shapes, input checks, and that a sequence's logits and
gradients do not depend on what it is packed with (one process; CP is in tests/distributed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thdpack.attention import AttentionConfig
from thdpack.models import ModelConfig, Transformer
from thdpack.packing.packer import assemble_pack, read_sample
from thdpack.thd import thd_collate

TINY = ModelConfig.preset("tiny", attention=AttentionConfig(backend="math"))


def _thd(sequences: list[np.ndarray], pack_size: int) -> dict:
    pieces = [read_sample({"input_ids": s}, i) for i, s in enumerate(sequences)]
    return thd_collate([assemble_pack(pieces, pack_size)])


def test_same_seed_same_weights_any_dtype_and_different_seed_differs():
    a, b = Transformer(TINY, seed=3), Transformer(TINY, seed=3, dtype=torch.float64)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb.float()), name  # fp32 weights are the roundings of the fp64 ones
    c = Transformer(TINY, seed=4)
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)


def test_init_scales_and_tied_head():
    config = ModelConfig.preset("tiny", dim=64, n_layers=8, ffn_dim=256, vocab_size=512)
    model = Transformer(config, seed=0, dtype=torch.float64)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert abs(model.embed_tokens.weight.std().item() - 0.02) < 2e-3
    assert abs(model.layers[0].mlp.down_proj.weight.std().item() - 0.02 / 4) < 5e-4  # / sqrt(2 * 8)
    assert torch.equal(model.layers[3].input_layernorm.weight, torch.ones(64, dtype=torch.float64))
    untied = Transformer(ModelConfig.preset("tiny", tie_embeddings=False))
    assert untied.lm_head.weight is not untied.embed_tokens.weight


def test_meta_device_then_init_weights_matches_eager_build():
    lazy = Transformer(TINY, device="meta")
    assert lazy.embed_tokens.weight.is_meta
    lazy = lazy.to_empty(device="cpu")
    lazy.init_weights(7)
    eager = Transformer(TINY, seed=7)
    for pa, pb in zip(lazy.parameters(), eager.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_forward_shape_and_dtype():
    model = Transformer(TINY, dtype=torch.float64)
    thd = _thd([np.arange(1, 6), np.arange(1, 4)], 10)
    logits = model(thd)
    assert logits.shape == (10, 64) and logits.dtype == torch.float64
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"position_ids": None}, ValueError, r"the THD batch lacks \['position_ids'\]; build it with thdpack.to_thd"),
        ({"input_ids": torch.zeros(2, 5, dtype=torch.long)}, ValueError, r"input_ids must be a 1-D \(T,\) tensor"),
        ({"position_ids": torch.zeros(8)}, TypeError, r"position_ids must be an integer tensor, got torch.float32"),
        (
            {"position_ids": torch.zeros(7, dtype=torch.long)},
            ValueError,
            r"input_ids has 8 tokens but position_ids has 7",
        ),
    ],
)
def test_bad_batches_are_rejected(change, error, match):
    thd = _thd([np.arange(1, 9)], 8)
    for key, value in change.items():
        if value is None:
            del thd[key]
        else:
            thd[key] = value
    with pytest.raises(error, match=match):
        Transformer(TINY)(thd)


def test_config_must_be_a_model_config():
    with pytest.raises(TypeError, match=r"config must be a thdpack ModelConfig, got dict"):
        Transformer({"dim": 32})  # type: ignore[arg-type]


@settings(max_examples=15)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=5),
    tail=st.integers(0, 5),
    causal=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_packed_logits_and_gradients_equal_each_sequence_alone(lengths, tail, causal, seed):
    model = Transformer(
        ModelConfig.preset("tiny", attention=AttentionConfig(backend="math", causal=causal)), dtype=torch.float64
    )
    rng = np.random.default_rng(seed)
    sequences = [rng.integers(0, 64, n) for n in lengths]
    pack = _thd(sequences, sum(lengths) + tail)
    weights = torch.randn(sum(lengths) + tail, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    real = ~pack["padding_mask"]
    packed_logits = model(pack)
    (packed_logits[real] * weights[real]).sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone, start = [], 0
    for s in sequences:
        logits = model(_thd([s], len(s)))
        (logits * weights[start : start + len(s)]).sum().backward()
        alone.append(logits.detach())
        start += len(s)
    torch.testing.assert_close(packed_logits[real].detach(), torch.cat(alone), rtol=0, atol=1e-10)
    for got, p in zip(packed_grads, model.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad, rtol=0, atol=1e-10)


def test_a_wrong_boundary_changes_the_logits():
    """The equality above is not vacuous: one sequence in place of two changes the second's logits."""
    model = Transformer(TINY, dtype=torch.float64)
    two = _thd([np.arange(1, 5), np.arange(5, 9)], 8)
    one = _thd([np.arange(1, 9)], 8)
    one["position_ids"] = two["position_ids"]  # same RoPE positions: only the attention boundary differs
    assert (model(two)[4:] - model(one)[4:]).abs().max() > 1e-3
