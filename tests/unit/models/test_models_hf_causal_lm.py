"""``thdpack.models.hf.causal_lm``: Hugging Face causal LMs behind thdpack's model interface."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers

from thdpack.attention import AttentionConfig
from thdpack.models.hf.causal_lm import (
    ARCHITECTURES,
    ATTENTION_NAME,
    HFModelConfig,
    build_hf_model,
    save_hf_folder,
)
from thdpack.packing.packer import pack_from_segments
from thdpack.thd import thd_collate, thd_to_device

TINY = {"vocab_size": 101, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 48}
LENGTHS = (6, 1, 9)


def _row():
    torch.manual_seed(3)
    samples = [{"input_ids": torch.randint(3, 101, (n,)).tolist()} for n in LENGTHS]
    return samples, thd_collate([pack_from_segments(samples, (range(3), [0, 0, 0], LENGTHS), 20)])


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_each_architecture_builds_with_thdpack_attention_and_packs_exactly(arch):
    model = build_hf_model(HFModelConfig(arch=arch, **TINY), seed=0, dtype=torch.float64).eval()
    assert model.config._attn_implementation == ATTENTION_NAME and model.config.use_cache is False
    assert type(model.hf).__name__ == f"{ARCHITECTURES[arch]}ForCausalLM"
    again = build_hf_model(HFModelConfig(arch=arch, **TINY), seed=0, dtype=torch.float64)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), f"seed 0 gave different {name}"
    reference = copy.deepcopy(model.hf)
    reference.config._attn_implementation = "sdpa"
    samples, thd = _row()
    with torch.no_grad():
        logits = model(thd)
        start = 0
        for sample, n in zip(samples, LENGTHS, strict=True):
            alone = reference(input_ids=torch.tensor([sample["input_ids"]]), use_cache=False).logits[0]
            # transformers keeps RMSNorm / softmax in fp32 inside an fp64 model: fp32-sized differences
            torch.testing.assert_close(logits[start : start + n], alone, atol=1e-6, rtol=1e-6)
            start += n


def test_random_initialisation_defaults_to_the_small_preset_not_transformers_7b():
    kwargs = HFModelConfig().transformers_kwargs()
    assert (kwargs["hidden_size"], kwargs["num_hidden_layers"], kwargs["vocab_size"]) == (128, 2, 50257)
    assert HFModelConfig(arch="mistral").transformers_kwargs()["sliding_window"] is None


def test_the_run_attention_config_reaches_every_layer():
    model = build_hf_model(HFModelConfig(**TINY, attention=AttentionConfig(backend="te")), seed=0)
    _, thd = _row()
    with pytest.raises(ImportError, match="backend 'te' needs Transformer Engine"):
        model(thd)


def test_saved_folder_loads_in_plain_transformers_with_the_tokenizer(tmp_path):
    model = build_hf_model(HFModelConfig(**TINY), seed=0)
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    (tokenizer / "tokenizer_config.json").write_text("{}")
    folder = save_hf_folder(model, tmp_path / "hf", tokenizer=str(tokenizer))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in folder.iterdir()
    }
    assert ATTENTION_NAME not in json.loads((folder / "config.json").read_text()).values()
    assert model.config._attn_implementation == ATTENTION_NAME  # the live model keeps thdpack's attention
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    for name, tensor in model.hf.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"arch": "gpt2"}, "model.arch='gpt2' is not one of llama, qwen2, mistral, gemma"),
        ({"path": "/m", "n_layers": 4}, "so model.n_layers=4 would be ignored"),
        ({"dim": 0}, "model.dim must be an int >= 1, got 0"),
    ],
)
def test_bad_configs_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        HFModelConfig(**fields)


def test_a_folder_without_config_json_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"holds no config\.json"):
        build_hf_model(HFModelConfig(path=str(tmp_path)), seed=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the GPU attention kernels under transformers")
def test_packed_hf_model_on_cuda_in_bf16_matches_sdpa_per_sequence():
    model = build_hf_model(HFModelConfig(**TINY), seed=0, device="cuda").eval()
    reference = copy.deepcopy(model.hf)
    reference.config._attn_implementation = "sdpa"
    samples, thd = _row()
    thd = thd_to_device(thd, "cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(thd).float()
        start = 0
        for sample, n in zip(samples, LENGTHS, strict=True):
            ids = torch.tensor([sample["input_ids"]], device="cuda")
            alone = reference(input_ids=ids, use_cache=False).logits[0].float()
            torch.testing.assert_close(logits[start : start + n], alone, atol=5e-2, rtol=5e-2)
            start += n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: transformers' flash_attention_2")
def test_transformers_own_flash_attention_2_fed_by_hf_packed_kwargs_matches_sdpa_per_sequence():
    """Issue 26: a packed row through transformers' own ``flash_attention_2`` (``cu_seq_lens_*`` and
    ``max_length_*`` from ``hf_packed_kwargs``, no thdpack attention in the model) had no test."""
    from transformers.utils import is_flash_attn_2_available

    from thdpack.models.hf.attention import hf_packed_kwargs

    if not is_flash_attn_2_available():
        pytest.skip("transformers finds no flash-attn 2 here (pip install 'thdpack[flash]')")
    config = transformers.LlamaConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    flash = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    flash.set_attn_implementation("flash_attention_2")
    reference = copy.deepcopy(flash)
    reference.set_attn_implementation("sdpa")
    samples, thd = _row()
    thd = thd_to_device(thd, "cuda")
    kwargs = hf_packed_kwargs(thd, model=flash)
    assert "cu_seq_lens_q" in kwargs and "max_length_q" in kwargs
    with torch.no_grad():
        logits = flash(**kwargs).logits[0]
        start = 0
        for sample, n in zip(samples, LENGTHS, strict=True):
            ids = torch.tensor([sample["input_ids"]], device="cuda")
            alone = reference(input_ids=ids, use_cache=False).logits[0]
            torch.testing.assert_close(logits[start : start + n].float(), alone.float(), atol=5e-2, rtol=5e-2)
            start += n
