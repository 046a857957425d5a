"""``model=hf``: a Hugging Face causal LM trained by the trainer (issue 10, item 3).

A random tiny Llama trains under ``torchrun`` with 2 processes and CP 2, resumes exactly, and
writes a Hugging Face folder whose weights are the checkpoint's and that plain transformers loads
with the logits of thdpack's packed, CP-ready model. In-process runs (one rank) cover a local
folder as ``model.path``, FSDP2 with bf16-mixed, activation checkpointing and the config errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from test_train import losses, torchrun
from test_train_checkpoints import config
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from thdpack.train.trainer import run

pytestmark = pytest.mark.distributed
HF = ["model=hf", "train.checkpoint_every=2"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache) -> Path:
    """4 steps of a random Llama, 2 processes, CP 2."""
    out = tmp_path_factory.mktemp("straight")
    torchrun(out, cache, *HF, "train.steps=4")
    return out


def _weights(folder: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint folder, keyed like the Hugging Face model's."""
    dcp_to_torch_save(folder / "dcp", tmp / "flat.pt")
    model = torch.load(tmp / "flat.pt", weights_only=False)["model"]
    return {name.removeprefix("hf."): tensor for name, tensor in model.items()}


def test_cp2_run_resumes_exactly(tmp_path, cache, straight):
    split = tmp_path / "split"
    torchrun(split, cache, *HF, "train.steps=4", "train.stop_at=2")
    result = torchrun(split, cache, *HF, "train.steps=4", "train.resume=true")
    assert "(step 2)" in result.stdout
    values = losses(straight)
    assert len(values) == 4 and all(v == v for v in values)
    assert losses(split) == values


def test_the_hf_folder_holds_the_checkpoint_weights_and_loads_with_the_same_logits(tmp_path, straight):
    from safetensors.torch import load_file

    folder = straight / "hf"
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert (straight / "checkpoints" / "step_000004" / "hf" / "model.safetensors").is_file()  # verified with it
    saved = load_file(folder / "model.safetensors")
    trained = _weights(straight / "checkpoints" / "step_000004", tmp_path)
    for name, tensor in saved.items():
        assert torch.equal(tensor, trained[name]), name
    assert set(trained) - set(saved) <= {"lm_head.weight"}  # tied to the embedding

    from thdpack.models.hf.causal_lm import HFModelConfig, build_hf_model
    from thdpack.packing.packer import pack_from_segments
    from thdpack.thd import thd_collate

    plain = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert plain.config._attn_implementation in ("sdpa", "eager")
    packed = build_hf_model(HFModelConfig(path=str(folder)), seed=0).eval()
    torch.manual_seed(0)
    lengths = [7, 3, 12]
    samples = [{"input_ids": torch.randint(3, 1000, (n,)).tolist()} for n in lengths]
    thd = thd_collate([pack_from_segments(samples, (range(3), [0, 0, 0], lengths), 24)])
    with torch.no_grad():
        logits = packed(thd)
        start = 0
        for sample, n in zip(samples, lengths, strict=True):
            alone = plain(input_ids=torch.tensor([sample["input_ids"]])).logits[0]
            torch.testing.assert_close(logits[start : start + n], alone, atol=2e-5, rtol=1e-5)
            start += n


def test_a_local_folder_trains_with_fsdp_bf16_mixed_and_activation_checkpointing(tmp_path, cache, straight):
    out = tmp_path / "from_folder"
    overrides = [
        "model=hf",
        f"model.path={straight / 'hf'}",
        "model.dim=null",
        "model.n_layers=null",
        "model.n_heads=null",
        "model.n_kv_heads=null",
        "model.ffn_dim=null",
        "parallel.cp_size=1",
        "parallel.dp_sharding=fsdp",
        "train.precision=bf16-mixed",
        "train.activation_checkpointing=true",
        "train.steps=2",
        "train.checkpoint_every=0",
    ]
    history = run(config(out, cache, *overrides))
    assert len(history) == 2 and all(r["loss"] == r["loss"] for r in history)
    assert history[0]["loss"] < losses(straight)[0]  # it starts from the trained weights, not random ones
    assert (out / "hf" / "model.safetensors").is_file()


@pytest.mark.parametrize("model", [[], ["model=hf"]], ids=["thdpack", "hf"])
def test_activation_checkpointing_changes_no_loss(tmp_path, cache, model):
    runs = {}
    for flag in ("false", "true"):
        out = tmp_path / flag
        run(config(out, cache, *model, "parallel.cp_size=1", "train.steps=2", f"train.activation_checkpointing={flag}"))
        runs[flag] = losses(out)
    assert runs["true"] == runs["false"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=hf", "model.path=/nowhere"], "model.path='/nowhere' holds no config.json"),
        (["model=hf", "model.arch=gpt2"], "model.arch='gpt2' is not one of llama, qwen2, mistral, gemma"),
        (["model=hf", "model.path=/models/x", "model.arch=llama"], "its config.json decides the architecture"),
        (["model.path=/models/x"], "model.path=/models/x applies to Hugging Face models only: add model=hf"),
        (["model.trust_remote_code=true"], "model.trust_remote_code=true applies to Hugging Face models only"),
        # issue 17: named before a model is built or a step is run
        (["model=hf", "model.dim=30"], "head dim model.dim // model.n_heads = 15 is odd; RoPE rotates pairs"),
        (["train.save_hf=true"], "train.save_hf=true writes a Hugging Face folder, which only model=hf runs have"),
    ],
)
def test_bad_hf_settings_are_named(tmp_path, cache, overrides, message):
    base = [
        "model.dim=null",
        "model.n_layers=null",
        "model.n_heads=null",
        "model.n_kv_heads=null",
        "model.ffn_dim=null",
    ]
    extra = base if any("path" in o for o in overrides) and "model=hf" in overrides else []
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run(config(tmp_path, cache, *overrides, *extra, "parallel.cp_size=1", "train.steps=1"))


def test_a_model_folder_that_ships_code_is_refused_by_the_real_entry(tmp_path, cache):
    """Issue 26: ``echo y | python -m thdpack.train model=hf model.path=DIR`` answered transformers'
    "[y/N]" prompt and ran the folder's code (config.json's auto_map)."""
    import json
    import os
    import subprocess
    import sys

    from test_train import REPO, TINY

    folder, marker = tmp_path / "model", tmp_path / "code_ran"
    llama = transformers.LlamaConfig(
        vocab_size=50_257, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
    )
    transformers.LlamaForCausalLM(llama).save_pretrained(folder)
    config_json = json.loads((folder / "config.json").read_text())
    auto_map = {"AutoConfig": "shipped.ShippedConfig", "AutoModelForCausalLM": "shipped.ShippedForCausalLM"}
    (folder / "config.json").write_text(json.dumps({**config_json, "model_type": "shipped", "auto_map": auto_map}))
    (folder / "shipped.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    model = ["model=hf", f"model.path={folder}", *(f"model.{k}=null" for k in ("dim", "n_layers", "n_heads"))]
    model += ["model.n_kv_heads=null", "model.ffn_dim=null"]
    cmd = [sys.executable, "-m", "thdpack.train", *TINY, *model, f"data.cache_dir={cache}"]
    cmd += [f"train.output_dir={tmp_path / 'out'}", "parallel.cp_size=1", "train.steps=1"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=REPO, env=env, input="y\n", capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "which thdpack does not run unless told: read that code, then set model.trust_remote_code=true" in (
        result.stderr
    )
    assert not marker.exists()


def test_a_model_folder_with_its_own_tokenizer_refuses_a_store_of_another(tmp_path, cache):
    """Issue 17: a folder shipping a 60,001-id tokenizer trained on the GPT-2 stdlib store, since
    only the vocabulary sizes were compared (the model's 60,001 >= the store's 50,257)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    folder = tmp_path / "model"
    llama = transformers.LlamaConfig(
        vocab_size=60_001,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    transformers.LlamaForCausalLM(llama).save_pretrained(folder)
    Tokenizer(WordLevel({f"w{i}": i for i in range(60_001)}, unk_token="w0")).save(str(folder / "tokenizer.json"))
    sizes = [f"model.{name}=null" for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")]
    overrides = ["model=hf", f"model.path={folder}", *sizes, "parallel.cp_size=1", "train.steps=1"]
    with pytest.raises(ValueError, match=r"was tokenized with 'gpt2' \(50,257 ids.* ships another tokenizer \(60,001"):
        run(config(tmp_path / "out", cache, *overrides))
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_adaptive_cp_placement_with_fsdp_trains_and_resumes_exactly(tmp_path, cache):
    """model=hf with FSDP2 and packing.cp_placement=adaptive, cp 2 under torchrun: the placed
    shards go through the HF adapter, a run stopped at step 2 and resumed repeats the straight
    run's losses."""
    adaptive = [*HF, "parallel.dp_sharding=fsdp", "packing.cp_placement=adaptive", "train.steps=4"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    result = torchrun(straight, cache, *adaptive)
    assert "cp placement: adaptive (tiles): " in result.stdout
    values = losses(straight)
    assert len(values) == 4 and all(v == v for v in values)
    torchrun(split, cache, *adaptive, "train.stop_at=2")
    result = torchrun(split, cache, *adaptive, "train.resume=true")
    assert "(step 2)" in result.stdout
    assert losses(split) == values
