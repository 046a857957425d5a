"""ThdpackTrainer in one process (no CP): its refusals, the pack stream's checkpoint file, and one
exact training step with transformers' own sdpa kept on packed rows; the trainers' dataset at cp 2
(built without processes): an adaptive plan's placement reaches the packs and the CP shards. Its
settings are tested in test_integrations_packing_arguments.py, the CP runs (2 and 4 processes) in
tests/distributed/test_integrations_distributed.py."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

pytest.importorskip("trl", reason="the Trainer integration is tested with thdpack[trl] (transformers, trl, accelerate)")

import torch
from transformers import TrainingArguments

from thdpack.cp.topology import CpTopology
from thdpack.integrations.parallel import accelerator_topology
from thdpack.integrations.stream_state import STATE_FILE, read_stream_state, write_stream_state
from thdpack.integrations.trainer_data import HFSamples, StepSource, packed_dataset
from thdpack.integrations.transformers import PackingArguments, ThdpackTrainer
from thdpack.thd.carriage import thd_meta
from thdpack.thd.parts import shard_parts

from support.hf_cases import keep_float64
from support.trainer_cases import (
    MIXED_LENGTHS,
    RecordLosses,
    cpu_arguments,
    max_difference,
    reference_run,
    sgd,
    step_examples,
    tiny_llama,
    token_examples,
    weights,
)


def _args(tmp_path, **overrides) -> TrainingArguments:
    steps = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1, max_grad_norm=1.0)
    return cpu_arguments(TrainingArguments, tmp_path, **{**steps, **overrides})


def _trainer(tmp_path, model=None, packing=None, args=None, **kwargs) -> ThdpackTrainer:
    return ThdpackTrainer(
        model=model or tiny_llama(),
        args=args or _args(tmp_path),
        train_dataset=token_examples(),
        packing=packing or PackingArguments(pack_size=32),
        **kwargs,
    )


def _cp2_dataset(cp_placement: str):
    samples = HFSamples(token_examples(MIXED_LENGTHS))
    config = PackingArguments(cp_placement=cp_placement).dataset_config(pack_size=32, overflow="error", seed=0)
    topology = CpTopology(dp_size=1, cp_size=2, rank=0, gpus_per_node=2)
    return packed_dataset(config, samples, topology, pad_id=0, lengths=samples.lengths())


def test_an_adaptive_plan_reaches_the_packs_and_the_cp_shards():
    """cp 2 without processes (cp 2 needs no placement process groups): the plan's placement is in
    every pack (``cp_group_size`` / ``cp_group_start`` per sequence, then one padding entry per
    rank) and each CP rank's shard runs it in parts (a split part over both ranks, a whole part);
    TE's layout has neither."""
    dataset = _cp2_dataset("adaptive")
    epoch = dataset.epochs[0]
    assert "sequences whole on one CP rank" in dataset.plan.placement_summary()
    for i, planned in enumerate(epoch.order.tolist()):
        placed, pack = epoch.plan.placement.pack(planned), dataset[i]
        S = len(placed.lengths_S)
        assert pack["cp_group_size"].tolist() == [*placed.group_size_S.tolist(), 1, 1]
        assert pack["cp_group_start"].tolist() == [*placed.group_start_S.tolist(), 0, 1]
        assert pack["seq_lens"][:S].tolist() == placed.lengths_S.tolist()
    assert set(epoch.plan.placement.group_size.tolist()) == {1, 2}
    part_sizes = set()
    for cp_rank in (0, 1):
        stream = dataset.step_stream(micro_batches=1, packs_per_micro_batch=len(dataset))
        source = StepSource(stream, cp_size=2, cp_rank=cp_rank, device=torch.device("cpu"), num_examples=0)
        micro = source[(0, 0)]
        assert len(micro["input_ids"]) == 32 * len(dataset) // 2
        part_sizes |= {part.group_size for part in shard_parts(thd_meta(micro))}
    assert part_sizes == {1, 2}

    te = _cp2_dataset("te")
    assert te.plan.placement is None and te.plan.placement_summary() is None and "cp_group_size" not in te[0]


class Recording(RecordLosses, ThdpackTrainer):
    pass


def test_one_process_step_equals_unpacked_training_with_sdpa_kept(tmp_path):
    """No CP: transformers' sdpa stays (exact on packed rows from the position ids); two packs per
    micro-batch, two micro-batches, clipping: the loss and the updated weights equal unpacked
    training of the step's examples."""
    model = tiny_llama(implementation="sdpa")
    trainer = Recording(
        model=model,
        args=_args(tmp_path),
        train_dataset=token_examples(),
        optimizers=sgd(model),
        packing=PackingArguments(pack_size=32),
    )
    initial = weights(model)
    with keep_float64():
        trainer.train()
    assert model.config._attn_implementation == "sdpa"
    reference = tiny_llama()
    reference.load_state_dict(initial, strict=False)
    ref_losses, ref_weights = reference_run(reference, token_examples(), step_examples(trainer.packed_dataset, 4, 1))
    assert abs(float(sum(trainer.micro_losses)) - ref_losses[0]) <= 1e-10
    assert max_difference(weights(model), ref_weights) <= 1e-10
    assert max_difference(weights(model), initial) > 1e-3


def custom_attention(*args, **kwargs):
    raise AssertionError("never called: the trainer refuses the model first")


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("no pack size", r"ThdpackTrainer needs packing=PackingArguments\(pack_size=...\)"),
        ("collator", "data_collator would never be called: thdpack builds the packed batches"),
        ("eval", "cannot train with evaluation .eval_dataset / eval_strategy."),
        ("label smoothing", "cannot train with label_smoothing_factor > 0: the loss is thdpack's"),
        ("cp in one process", "cp_size=2 does not divide the world size 1; launch a multiple of 2 processes"),
        ("pack too small", "sequence 0 has 13 tokens, over pack_size=8 .6 sequences in total.; use overflow="),
        ("custom attention", "the model's attention 'my_attention' is not known to be exact on a packed row"),
    ],
)
def test_refusals(tmp_path, case, match):
    import transformers

    transformers.AttentionInterface.register("my_attention", custom_attention)
    kwargs = {
        "no pack size": dict(packing=PackingArguments()),
        "collator": dict(data_collator=lambda batch: batch),
        "eval": dict(eval_dataset=token_examples()),
        "label smoothing": dict(args=_args(tmp_path, label_smoothing_factor=0.1)),
        "cp in one process": dict(packing=PackingArguments(pack_size=32, cp_size=2)),
        "pack too small": dict(packing=PackingArguments(pack_size=8)),
        "custom attention": dict(model=tiny_llama(implementation="my_attention")),
    }[case]
    with pytest.raises(ValueError, match=match):
        _trainer(tmp_path, **kwargs)


def test_tensor_parallelism_is_refused():
    accelerator = SimpleNamespace(
        num_processes=2, process_index=0, parallelism_config=SimpleNamespace(tp_size=2, sp_size=1, cp_size=1)
    )
    with pytest.raises(ValueError, match="ParallelismConfig has tp_size=2, sp_size=1: thdpack's packed batches"):
        accelerator_topology(accelerator, None, placement_groups=False)


def test_evaluate_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has no packed evaluation loop yet"):
        _trainer(tmp_path).evaluate()


def test_the_stream_state_file_round_trips_and_damage_is_detected(tmp_path):
    state = {"steps_done": 3, "stream": {"epoch": 1, "position": 2, "packs_per_step": 4}}
    path = write_stream_state(tmp_path, state)
    assert path.name == STATE_FILE and read_stream_state(tmp_path) == state
    record = json.loads(path.read_text())
    record["state"]["stream"]["position"] = 3
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"is damaged .its checksum does not match."):
        read_stream_state(tmp_path)
    path.write_text("{")
    with pytest.raises(ValueError, match="is damaged"):
        read_stream_state(tmp_path)
    with pytest.raises(ValueError, match=r"has no thdpack_stream\.json: it was not written by thdpack's trainer"):
        read_stream_state(tmp_path / "elsewhere")


def test_resuming_with_ignore_data_skip_is_refused(tmp_path):
    trainer = _trainer(tmp_path, args=_args(tmp_path, ignore_data_skip=True))
    with pytest.raises(ValueError, match="ignore_data_skip=True would retrain the packs the checkpoint already"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))


def test_resuming_with_another_cp_placement_plans_the_rest_of_the_epoch_again(tmp_path, caplog):
    """The placement is part of the stream state a checkpoint saves (the PlanConfig's fingerprint);
    another one plans the epoch's rest again with it, saying so (before: refused)."""
    one_pack = dict(per_device_train_batch_size=1, gradient_accumulation_steps=1, save_strategy="steps", save_steps=1)
    trainer = _trainer(tmp_path, args=_args(tmp_path, **one_pack))
    trainer.train()
    folder = tmp_path / "checkpoint-1"
    settings = read_stream_state(folder)["stream"]["settings"]
    assert (settings["cp_placement"], settings["cost_model"]) == ("adaptive", "tiles")
    te = PackingArguments(pack_size=32, cp_placement="te")
    other = _trainer(tmp_path, args=_args(tmp_path, **{**one_pack, "max_steps": 2}), packing=te)
    with caplog.at_level("WARNING", logger="thdpack.integrations.transformers"):
        other.train(resume_from_checkpoint=str(folder))
    assert "thdpack: resumed pack stream: PackingArguments.cp_placement adaptive -> te: the remaining " in caplog.text
    assert " sequences of epoch 0 are planned again with PackingArguments.cp_placement=te; losses will" in caplog.text
    assert other.state.global_step == 2


def test_a_checkpoint_from_another_trainer_is_refused(tmp_path):
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    with pytest.raises(ValueError, match=r"has no thdpack_stream\.json"):
        _trainer(tmp_path).train(resume_from_checkpoint=str(folder))


def test_the_model_is_called_with_the_packed_kwargs(tmp_path):
    trainer = _trainer(tmp_path, model=tiny_llama(implementation="sdpa"))
    micro = next(iter(trainer.get_train_dataloader()))
    kwargs = trainer.model_kwargs(micro)
    assert kwargs["input_ids"].shape == (1, 64)  # two packs of 32
    assert kwargs["use_cache"] is False and "cu_seq_lens_q" in kwargs
    with torch.no_grad():
        assert trainer.model(**kwargs).logits.shape == (1, 64, 97)


def test_truncation_is_reported(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="thdpack.integrations.transformers"):
        trainer = _trainer(tmp_path, packing=PackingArguments(pack_size=8, overflow="truncate"))
    cut = trainer.packed_dataset.stats.truncated_tokens
    assert cut == sum(max(0, n - 8) for n in (13, 1, 4, 9, 2, 15, 8, 6, 3, 11, 5, 7, 12, 10))
    assert (
        f"0 sequences dropped (0 tokens), {cut} tokens truncated, of sequences longer than pack_size=8" in caplog.text
    )


@pytest.mark.parametrize(
    ("example", "message"),
    [
        (
            {"input_ids": [5, 97, 6], "labels": [5, 97, 6]},
            r"example 2: input_ids holds 97 at position 1, not a token id of the vocabulary of 97 \(ids 0\.\.96\)",
        ),
        ({"input_ids": [5, 6, 7], "labels": [-100, 6, 200]}, r"example 2: labels holds 200 at position 2, not a"),
        ({"input_ids": [5, -3, 7]}, r"example 2: input_ids holds -3 at position 1, not a token id"),
    ],
)
def test_token_ids_outside_the_models_vocabulary_are_named_before_training(tmp_path, example, message):
    """Issue 26: an id >= the vocabulary reached the embedding as a raw IndexError (a device-side
    assert on CUDA, and a gloo "Connection closed" from the other rank)."""
    examples = token_examples()
    examples[2] = example
    with pytest.raises(ValueError, match=message):
        ThdpackTrainer(
            model=tiny_llama(),
            args=_args(tmp_path),
            train_dataset=examples,
            packing=PackingArguments(pack_size=32),
        )


ONE_PACK = dict(per_device_train_batch_size=1, gradient_accumulation_steps=1, save_strategy="steps", save_steps=1)
"""A step of one pack, a checkpoint after each: checkpoint-1 is mid-epoch."""


def test_a_resume_on_other_data_of_the_same_size_is_refused_unless_told(tmp_path):
    """Issue 26 item 8: the stream state recorded only the number of sequences, so other examples of
    the same lengths resumed silently. Now it records the data's digest, as thdpack's trainer does."""
    _trainer(tmp_path, args=_args(tmp_path, **ONE_PACK)).train()
    folder = tmp_path / "checkpoint-1"

    def on_other_data(packing):
        args = _args(tmp_path, **{**ONE_PACK, "max_steps": 2})
        return ThdpackTrainer(model=tiny_llama(), args=args, train_dataset=token_examples(seed=1), packing=packing)

    refusal = (
        rf"checkpoint {folder} was trained on other data than this train_dataset \(sha256: checkpoint "
        r"[0-9a-f]{12}\.\.\., this run [0-9a-f]{12}\.\.\.\); resume with the data it was trained on, or pass "
        r"PackingArguments\(resume_data_changed=True\) to continue its model on this data"
    )
    with pytest.raises(ValueError, match=refusal):
        on_other_data(PackingArguments(pack_size=32)).train(resume_from_checkpoint=str(folder))
    trainer = on_other_data(PackingArguments(pack_size=32, resume_data_changed=True))
    trainer.train(resume_from_checkpoint=str(folder))
    assert trainer.state.global_step == 2
    saved, now = (read_stream_state(tmp_path / f"checkpoint-{k}") for k in (1, 2))
    assert saved["data"]["examples"] == now["data"]["examples"] and saved["data"]["sha256"] != now["data"]["sha256"]
    assert now["stream"]["position"] == 1  # the stream started at the other data's beginning


def test_the_data_digest_is_the_same_for_a_list_and_a_dataset():
    from datasets import Dataset

    examples = token_examples()
    assert HFSamples(examples).sha256 == HFSamples(Dataset.from_list(examples)).sha256
    assert HFSamples(examples).sha256 != HFSamples(token_examples(seed=1)).sha256
    unlabelled = [{"input_ids": ex["input_ids"]} for ex in examples]
    assert HFSamples(unlabelled).sha256 == HFSamples(Dataset.from_list(unlabelled)).sha256 != HFSamples(examples).sha256


def test_a_fresh_run_into_an_output_dir_with_another_runs_checkpoints_is_refused(tmp_path):
    """Issue 26 item 9: transformers overwrote another run's checkpoint-N silently. Now the trainer
    applies thdpack's one-run-per-folder rule: such a folder is refused, and so is one that another
    live run holds."""
    from thdpack.files.lock import FolderLock

    _trainer(tmp_path, args=_args(tmp_path, **ONE_PACK)).train()
    kept = (tmp_path / "checkpoint-1" / "thdpack_stream.json").read_bytes()
    refusal = (
        f"output_dir={tmp_path} holds the checkpoints of an earlier run (checkpoint-1); continue it with "
        "train(resume_from_checkpoint=True), write to a new output_dir, or delete them"
    )
    with pytest.raises(ValueError, match=re.escape(refusal)):
        _trainer(tmp_path, args=_args(tmp_path, **ONE_PACK)).train()
    assert (tmp_path / "checkpoint-1" / "thdpack_stream.json").read_bytes() == kept
    other_run = tmp_path / "other"
    _trainer(other_run, args=_args(other_run, **ONE_PACK)).train()
    with pytest.raises(ValueError, match=re.escape(refusal)):  # resumed from another folder's checkpoint into this one
        _trainer(tmp_path, args=_args(tmp_path, **{**ONE_PACK, "max_steps": 2})).train(
            resume_from_checkpoint=str(other_run / "checkpoint-1")
        )

    busy = tmp_path / "busy"
    holder = FolderLock(busy).acquire()
    try:
        with pytest.raises(ValueError, match=rf"output_dir={busy} is being written by another process \(pid "):
            _trainer(busy, args=_args(busy)).train()
    finally:
        holder.release()
