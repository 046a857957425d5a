"""thdpack's SFTTrainer in one process: TRL prepares the examples, thdpack packs them; the SFTConfig
fields it reads and refuses; and TRL's probe on accelerate's CP hook.

The probe (huggingface/trl#6843): perturb the first token of the first of two packed documents
and count the output positions that change. TRL's own packing without CP changes only the first
document's (50%); accelerate's CP hook, attached to the same model, changes all of them (100%).
torch's ``context_parallel`` (what accelerate's CP runs) has no CPU kernel (``NotImplementedError:
aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy``, torch 2.13), so the
hook is shown on one process: it replaces every layer's packed mask with plain causal attention
over the whole row, which is what the ring then computes across ranks. thdpack's side of the
probe (only the first document changes, at CP 2) runs in tests/distributed."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("trl", reason="the TRL integration needs thdpack[trl] (transformers, trl, accelerate)")

import torch
from datasets import Dataset

from thdpack.integrations.trl import SFTConfig, SFTTrainer

from support.trainer_cases import chat_tokenizer, chats, cpu_arguments, tiny_llama


def _config(tmp_path, **overrides) -> SFTConfig:
    return cpu_arguments(
        SFTConfig, tmp_path, **{"max_length": 64, "per_device_train_batch_size": 1, "max_steps": 1, **overrides}
    )


def _trainer(tmp_path, config=None, **kwargs) -> SFTTrainer:
    tokenizer = chat_tokenizer()
    return SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=config or _config(tmp_path),
        train_dataset=Dataset.from_list(chats(10)),
        processing_class=tokenizer,
        **kwargs,
    )


def test_trl_prepares_the_examples_and_thdpack_packs_them(tmp_path):
    config = _config(tmp_path, packing=True, packing_strategy="bfd_split", assistant_only_loss=True)
    trainer = _trainer(tmp_path, config)
    assert (config.packing, config.max_length) == (True, 64), "the user's SFTConfig is left as it was"
    assert trainer.train_dataset.column_names == ["messages", "input_ids", "labels"]  # not TRL's packed rows
    assert any(label == -100 for label in trainer.train_dataset[0]["labels"])  # the user turn is masked
    dataset = trainer.packed_dataset.config.plan
    assert (dataset.pack_size, dataset.overflow, dataset.algorithm) == (64, "split", "bfd")
    trainer.train()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(packing=True, packing_strategy="wrapped"), "packing_strategy='wrapped'"),
        (dict(truncation_mode="keep_end"), "truncation_mode='keep_end'"),
        (dict(loss_type="dft"), "loss_type='dft'"),
    ],
)
def test_refusals(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=f"thdpack's SFTTrainer cannot train with {match}"):
        _trainer(tmp_path, _config(tmp_path, **overrides))


def test_other_arguments_than_an_sft_config_are_refused(tmp_path):
    from transformers import TrainingArguments

    with pytest.raises(TypeError, match=r"pass args=SFTConfig\(...\)"):
        _trainer(tmp_path, TrainingArguments(str(tmp_path), use_cpu=True, report_to=[]))


def _changed_positions(model, inputs, seq_lengths) -> list[int]:
    """Per document: the positions whose logits change when the row's first token changes."""
    perturbed = dict(inputs, input_ids=inputs["input_ids"].clone())
    perturbed["input_ids"][0, 0] = (perturbed["input_ids"][0, 0] + 1) % model.config.vocab_size
    with torch.no_grad():
        changed_T = (model(**inputs).logits - model(**perturbed).logits)[0].abs().amax(dim=-1) > 1e-6
    bounds = torch.cumsum(torch.tensor([0, *seq_lengths]), 0).tolist()
    return [int(changed_T[a:b].sum()) for a, b in itertools.pairwise(bounds)]


def test_accelerate_cp_hook_lets_packed_documents_attend_to_each_other():
    from accelerate.big_modeling import _attach_context_parallel_hooks
    from trl.data_utils import pack_dataset
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    documents = torch.randint(3, 20, (2, 12), generator=torch.Generator().manual_seed(1)).tolist()
    packed = pack_dataset(Dataset.from_dict({"input_ids": documents}), seq_length=24, strategy="bfd")[0]
    row = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)([packed])
    inputs = {"input_ids": row["input_ids"], "position_ids": row["position_ids"], "use_cache": False}
    model = tiny_llama(vocab_size=20, implementation="sdpa").float().eval()
    assert _changed_positions(model, inputs, packed["seq_lengths"]) == [12, 0]  # TRL's packing, no CP: 50%
    _attach_context_parallel_hooks(model)
    assert _changed_positions(model, inputs, packed["seq_lengths"]) == [12, 12]  # accelerate's CP hook: 100%
