"""``thdpack.models.hf.folder``: a Hugging Face folder loads with its weights exactly, as a causal LM,
or is refused naming what is wrong (issue 17, item 5 and its unclear errors).

Every folder is a real ``save_pretrained`` of a tiny transformers model built here, then changed
the way a user's folder goes wrong: a config.json that no longer matches its safetensors, a
masked-LM encoder, no weights, a weights file cut short.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from thdpack.models.hf.causal_lm import HFModelConfig, build_hf_model

LLAMA = {
    "vocab_size": 101,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A two-layer Llama folder; tests copy it before changing it."""
    folder = tmp_path_factory.mktemp("llama") / "llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(folder)
    return folder


def _copy(folder: Path, tmp_path: Path, **config: object) -> Path:
    changed = tmp_path / "changed"
    shutil.copytree(folder, changed)
    if config:
        data = json.loads((changed / "config.json").read_text())
        (changed / "config.json").write_text(json.dumps({**data, **config}))
    return changed


def _build(folder: Path) -> torch.nn.Module:
    return build_hf_model(HFModelConfig(path=str(folder)), seed=0)


def test_an_intact_folder_loads_its_weights_exactly(llama):
    from safetensors.torch import load_file

    model = _build(llama)
    stored = load_file(llama / "model.safetensors")
    for name, tensor in stored.items():
        assert torch.equal(model.hf.state_dict()[name], tensor), name


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"num_hidden_layers": 3},
            r"9 tensors missing from its weights \(transformers would initialise them at random\): "
            r"model\.layers\.2\.input_layernorm\.weight, model\.layers\.2\.mlp\.down_proj\.weight, .* and 1 more",
        ),
        (
            {"num_hidden_layers": 1},
            r"9 tensors in its weights but not in the model config\.json describes \(they would be dropped\): "
            r"model\.layers\.1\.input_layernorm\.weight",
        ),
        (
            {"intermediate_size": 48},
            r"6 tensors of another shape than config\.json describes: model\.layers\.0\.mlp\.down_proj\.weight "
            r"\(\[32, 64\] in the files, \[32, 48\] by config\.json\)",
        ),
    ],
    ids=["missing", "unexpected", "mismatched"],
)
def test_weights_that_config_json_does_not_describe_are_named(llama, tmp_path, config, message):
    """A config.json of 3 layers over the safetensors of 2 trained with layer 2 random (transformers
    only printed "MISSING ... newly initialized")."""
    folder = _copy(llama, tmp_path, **config)
    with pytest.raises(ValueError, match=rf"{folder}: its config\.json and its weights disagree: {message}"):
        _build(folder)


def test_a_masked_lm_folder_is_refused_naming_what_was_found(tmp_path):
    """A BertForMaskedLM folder loaded as BertLMHeadModel and trained as a causal LM: its
    bidirectional attention lets every position see its targets (shown first, then refused)."""
    config = transformers.BertConfig(
        vocab_size=101, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    )
    torch.manual_seed(0)
    transformers.BertForMaskedLM(config).save_pretrained(tmp_path / "bert")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bert").eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        first = loaded(input_ids=ids).logits[0, 0]
        moved = loaded(input_ids=torch.tensor([[5, 6, 7, 9]])).logits[0, 0]
    assert not torch.allclose(first, moved)  # the last token changes position 0's logits: not causal
    with pytest.raises(
        ValueError,
        match=r"bert' is a BertLMHeadModel \(model_type 'bert', architectures \['BertForMaskedLM'\]\): its attention "
        r"layers bert\.encoder\.layer\.0\.attention\.self are bidirectional \(is_causal=False\).*causal language "
        r"models only",
    ):
        _build(tmp_path / "bert")


def test_a_folder_without_weights_names_the_folder_and_the_files_expected(llama, tmp_path):
    """It was "OSError: Error no file named model.safetensors, or pytorch_model.bin"."""
    folder = _copy(llama, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(
        ValueError,
        match=rf"model\.path='{folder}' holds no weights: expected model\.safetensors \(or "
        rf"model\.safetensors\.index\.json with its shards, or pytorch_model\.bin\) beside config\.json.*"
        r"holds \['config\.json', 'generation_config\.json'\]",
    ):
        _build(folder)


@pytest.mark.parametrize("damage", ["cut", "header"])
def test_a_damaged_safetensors_file_is_named(llama, tmp_path, damage):
    """It was "SafetensorError: Error while deserializing header: ...", with no file named."""
    folder = _copy(llama, tmp_path)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "cut" else data[:8] + b"\xff\xfe" + data[10:])
    with pytest.raises(ValueError, match=rf"{weights} \([\d,]+ bytes\) is not a readable safetensors file \("):
        _build(folder)


def test_a_sharded_folder_names_its_missing_shard(llama, tmp_path):
    folder = _copy(llama, tmp_path)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lists shards that .* lacks: \['model-00002-of-00002\.safetensors'\]"):
        _build(folder)


def test_a_config_json_transformers_rejects_is_named(llama, tmp_path):
    folder = _copy(llama, tmp_path, hidden_size=30)
    with pytest.raises(
        ValueError, match=r"config\.json: transformers rejects it \(.*hidden size \(30\) is not a multiple of the"
    ):
        _build(folder)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dim": 36}, r"head dim model\.dim // model\.n_heads = 9 is odd; .* \(with model\.dim=36: model\.n_heads="),
        ({"dim": 30}, r"model\.dim=30 is not a multiple of model\.n_heads=4; pick n_heads that divides dim"),
        ({"n_heads": 4, "n_kv_heads": 3}, r"model\.n_heads=4 is not a multiple of model\.n_kv_heads=3"),
        ({"arch": "qwen2", "dim": 30}, r"model\.dim=30 is not a multiple of model\.n_heads=4"),
    ],
)
def test_sizes_transformers_would_refuse_are_named_before_building(fields, message):
    """They were StrictDataclassClassValidationError tracebacks from transformers (or, for Qwen2, a
    model that builds and fails in its first forward)."""
    with pytest.raises(ValueError, match=message):
        HFModelConfig(**fields)
    assert HFModelConfig(arch="gemma", dim=30).transformers_kwargs()["hidden_size"] == 30  # its own head_dim


REMOTE_CODE = """
import pathlib
pathlib.Path({marker!r}).touch()
from transformers import LlamaConfig, LlamaForCausalLM


class ShippedConfig(LlamaConfig):
    model_type = "shipped"


class ShippedForCausalLM(LlamaForCausalLM):
    config_class = ShippedConfig
"""


def _with_remote_code(llama: Path, tmp_path: Path, model_type: str) -> tuple[Path, Path]:
    """A copy of ``llama`` whose config.json maps its classes to a ``shipped.py`` beside it (which
    touches the returned marker when imported)."""
    marker = tmp_path / "code_ran"
    auto_map = {"AutoConfig": "shipped.ShippedConfig", "AutoModelForCausalLM": "shipped.ShippedForCausalLM"}
    folder = _copy(llama, tmp_path, auto_map=auto_map, model_type=model_type)
    (folder / "shipped.py").write_text(REMOTE_CODE.format(marker=str(marker)))
    return folder, marker


@pytest.mark.parametrize("model_type", ["shipped", "llama"], ids=["own-type", "known-type"])
def test_a_folder_that_ships_code_is_refused_without_running_it(llama, tmp_path, monkeypatch, model_type):
    """It was transformers' "[y/N]" prompt on stdin (own model_type; ``echo y |`` ran the code), or
    transformers' own Llama silently in place of the folder's class (a known model_type)."""
    folder, marker = _with_remote_code(llama, tmp_path, model_type)
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("y\n"))  # the answer the prompt would read
    with pytest.raises(
        ValueError,
        match=rf"{folder / 'config.json'} maps its classes to code shipped with the model \(auto_map "
        r"\{AutoConfig: shipped\.ShippedConfig, AutoModelForCausalLM: shipped\.ShippedForCausalLM\}\), which "
        r"thdpack does not run unless told: read that code, then set model\.trust_remote_code=true",
    ):
        _build(folder)
    assert not marker.exists()


def test_trust_remote_code_runs_the_folder_code(llama, tmp_path):
    folder, marker = _with_remote_code(llama, tmp_path, "shipped")
    model = build_hf_model(HFModelConfig(path=str(folder), trust_remote_code=True), seed=0)
    assert marker.exists()
    assert type(model.hf).__name__ == "ShippedForCausalLM"
    with pytest.raises(ValueError, match=r"model\.trust_remote_code=true lets a model folder's own code run, and"):
        HFModelConfig(trust_remote_code=True)


def _pickled(llama: Path, tmp_path: Path, extra: object = None) -> Path:
    """A copy of ``llama`` with its weights in ``pytorch_model.bin`` (plus ``extra`` when given)."""
    from safetensors.torch import load_file

    folder = _copy(llama, tmp_path)
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save({**weights, **({"extra": extra} if extra is not None else {})}, folder / "pytorch_model.bin")
    return folder


def test_pickled_weights_load_exactly(llama, tmp_path):
    from safetensors.torch import load_file

    model = _build(_pickled(llama, tmp_path))
    for name, tensor in load_file(llama / "model.safetensors").items():
        assert torch.equal(model.hf.state_dict()[name], tensor), name


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (__import__("os").system, (f"touch {self.marker}",))


def test_pickled_weights_naming_code_are_refused_by_file(llama, tmp_path):
    """It was transformers' raw UnpicklingError traceback ("Weights only load failed ...")."""
    marker = tmp_path / "code_ran"
    folder = _pickled(llama, tmp_path, _RunsCode(marker))
    with pytest.raises(
        ValueError,
        match=rf"{folder / 'pytorch_model.bin'} is refused: it asks for the global posix\.system, and thdpack "
        "loads only tensors and plain values",
    ):
        _build(folder)
    assert not marker.exists()


def test_damaged_pickled_weights_are_named(llama, tmp_path):
    """It was "cannot load model.path=...: [Errno 22] Invalid argument", no file named."""
    folder = _pickled(llama, tmp_path)
    weights = folder / "pytorch_model.bin"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(
        ValueError, match=rf"{weights} \([\d,]+ bytes\) is not a readable PyTorch \(torch\.save zip\) file \("
    ):
        _build(folder)
