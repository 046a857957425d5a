"""Real transformers models (tiny random configs, fp64, no download) on packed rows: no sequence
attends to another with Hugging Face's own attention or with thdpack's, and what cannot be exact
is refused."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the Hugging Face path needs transformers (thdpack[dev])")

from thdpack.models.hf import hf_packed_kwargs, register_hf_attention  # noqa: E402
from thdpack.packing import build_pack  # noqa: E402
from thdpack.thd import thd_collate  # noqa: E402

LENGTHS = (5, 1, 9, 3, 7)
SMALL = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
ARCHITECTURES = {
    "Llama": {},
    "Qwen2": {},
    "Mistral": {"sliding_window": None},
    "Gemma": {"head_dim": 8},  # scaled embeddings, (1 + w) RMSNorm, GeLU MLP, its own head_dim
}


def _model(arch: str, implementation: str, **extra) -> torch.nn.Module:
    config = getattr(transformers, f"{arch}Config")(**SMALL, **{**ARCHITECTURES[arch], **extra})
    config._attn_implementation = implementation
    torch.manual_seed(0)
    return getattr(transformers, f"{arch}ForCausalLM")(config).double().eval()


def _packed_row():
    torch.manual_seed(1)
    samples = [{"input_ids": torch.randint(3, 97, (n,)).tolist()} for n in LENGTHS]
    pack = build_pack(samples, (range(len(LENGTHS)), [0] * len(LENGTHS), LENGTHS), 40, cp_size=2)
    return pack, thd_collate([pack])


def _worst_cross_talk(model, reference, *, use_cache: bool | None = None) -> float:
    """Max |packed - alone| over the real tokens of every sequence of the row."""
    pack, thd = _packed_row()
    kwargs = hf_packed_kwargs(thd, model=model)
    if use_cache is not None:
        kwargs["use_cache"] = use_cache
    worst, start = 0.0, 0
    with torch.no_grad():
        packed = model(**kwargs).logits[0]
        for real, slot in zip(pack["seq_lens"].tolist(), pack["seq_lens_padded"].tolist(), strict=True):
            alone = reference(input_ids=thd["input_ids"][start : start + real][None], use_cache=False).logits[0]
            worst = max(worst, float((packed[start : start + real] - alone).abs().max()))
            start += slot
    return worst


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("implementation", ["eager", "sdpa", "thdpack"])
def test_no_sequence_attends_to_another(arch, implementation):
    name = register_hf_attention() if implementation == "thdpack" else implementation
    # attention across sequences moves logits by 0.1-0.4 here; what remains is float rounding
    assert _worst_cross_talk(_model(arch, name), _model(arch, "eager")) < 1e-6


def test_the_check_can_fail_a_cache_lets_sequences_attend_to_each_other():
    """The reported bug: with transformers' default use_cache=True, sdpa sees the whole row."""
    assert _worst_cross_talk(_model("Llama", "sdpa"), _model("Llama", "eager"), use_cache=True) > 1e-3


def test_sliding_windows_are_refused_by_thdpack_attention():
    model = _model("Mistral", register_hf_attention(), sliding_window=4)
    _, thd = _packed_row()
    with pytest.raises(ValueError, match="thdpack attention supports neither sliding windows nor softcapping"):
        model(**hf_packed_kwargs(thd, model=model))
