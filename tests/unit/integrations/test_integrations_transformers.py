"""ThdpackTrainer in one process (no CP): its settings, its refusals, the pack stream's checkpoint
file, and one exact training step with transformers' own sdpa kept on packed rows; the trainers'
dataset at cp 2 (built without processes): an adaptive plan's placement reaches the packs and the
CP shards. The CP runs (2 and 4 processes) are in tests/distributed/test_integrations_distributed.py."""

from __future__ import annotations

import dataclasses
import json
import re
from types import SimpleNamespace

import pytest

pytest.importorskip("trl", reason="the Trainer integration is tested with thdpack[trl] (transformers, trl, accelerate)")

import torch
from _hf_cases import keep_float64
from _trainer_cases import (
    MIXED_LENGTHS,
    RecordLosses,
    max_difference,
    reference_run,
    sgd,
    step_examples,
    tiny_llama,
    token_examples,
    weights,
)
from transformers import TrainingArguments

from thdpack.attention.config import AttentionConfig
from thdpack.cp.topology import CpTopology
from thdpack.integrations.hf_data import HFSamples, StepSource
from thdpack.integrations.parallel import accelerator_topology
from thdpack.integrations.stream_state import STATE_FILE, read_stream_state, write_stream_state
from thdpack.integrations.transformers import PackingArguments, ThdpackTrainer, packed_dataset
from thdpack.packing.dataset import PackedDatasetConfig
from thdpack.plan.config import TRAINING_CP_PLACEMENT, PlanConfig
from thdpack.thd.carriage import thd_meta
from thdpack.thd.parts import shard_parts


def _args(tmp_path, **overrides) -> TrainingArguments:
    settings = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        max_grad_norm=1.0,
    )
    return TrainingArguments(str(tmp_path), **{**settings, **overrides})


def _trainer(tmp_path, model=None, packing=None, args=None, **kwargs) -> ThdpackTrainer:
    return ThdpackTrainer(
        model=model or tiny_llama(),
        args=args or _args(tmp_path),
        train_dataset=token_examples(),
        packing=packing or PackingArguments(pack_size=32),
        **kwargs,
    )


def test_packing_arguments():
    assert PackingArguments().shuffle_packs and not PackingArguments(algorithm="sequential").shuffle_packs
    assert PackingArguments(algorithm="window", shuffle=True).shuffle_packs
    with pytest.raises(ValueError, match="pack_size must be >= 1, got 0"):
        PackingArguments(pack_size=0)
    with pytest.raises(ValueError, match="unknown overflow policy 'wrap'; valid: error, drop, truncate, split"):
        PackingArguments(overflow="wrap")
    assert PackingArguments().cp_placement == TRAINING_CP_PLACEMENT == "adaptive"
    assert PackingArguments().cost_model == "tiles"
    with pytest.raises(ValueError, match="unknown cp_placement 'ring'; valid: te, adaptive, auto"):
        PackingArguments(cp_placement="ring")
    with pytest.raises(ValueError, match="unknown cost_model 'flops'; valid: tiles, pairs, time"):
        PackingArguments(cost_model="flops")
    with pytest.raises(TypeError, match=r"cp_size must be an integer, got 2\.0"):
        PackingArguments(cp_size=2.0)


@pytest.mark.parametrize("value", [8.5, 8.0, "8", True, 0, 2**41])
def test_a_bad_pack_size_raises_what_the_plan_config_raises(value):
    """The fields are PlanConfig's, with its checks: the same class and message (ValueError before)."""
    with pytest.raises((TypeError, ValueError)) as expected:
        PlanConfig(pack_size=value)
    with pytest.raises(expected.type, match=re.escape(str(expected.value))):
        PackingArguments(pack_size=value)


def test_every_plan_and_dataset_setting_is_a_packing_argument_with_its_help():
    names = {f.name: f for f in dataclasses.fields(PackingArguments)}
    wanted = {f.name for f in dataclasses.fields(PlanConfig)} | {
        f.name for f in dataclasses.fields(PackedDatasetConfig)
    }
    # the seed is the Trainer's data_seed, remainder plays no part in a step stream, plan is listed flat
    assert set(names) == wanted - {"seed", "remainder", "plan"} | {"cp_size", "attention"}
    for f in dataclasses.fields(PlanConfig):
        if f.name != "seed":
            assert names[f.name].metadata["help"].startswith(f.metadata["help"])
    assert PackingArguments(improve=False).dataset_config(pack_size=64, overflow="error", seed=0).plan.improve is False


def test_the_attention_settings_may_be_a_mapping_as_yaml_gives_them():
    """PackingArguments(attention={...}) (YAML, a command line) builds the AttentionConfig, whose
    own checks apply; it failed in the trainer with "replace() should be called on dataclass instances"."""
    assert PackingArguments(attention={"backend": "math", "cp_comm_type": "a2a"}).attention == AttentionConfig(
        backend="math", cp_comm_type="a2a"
    )
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        PackingArguments(attention={"backend": "fast"})
    with pytest.raises(TypeError, match="attention: AttentionConfig has no setting 'kernel'; its settings: backend"):
        PackingArguments(attention={"kernel": "math"})
    with pytest.raises(TypeError, match="attention must be an instance of AttentionConfig or a mapping"):
        PackingArguments(attention="math")


def test_hf_argument_parser_reads_packing_arguments():
    from transformers import HfArgumentParser

    parser = HfArgumentParser(PackingArguments)
    (args,) = parser.parse_args_into_dataclasses(["--pack_size", "64", "--cp_placement", "te", "--improve", "false"])
    assert (args.pack_size, args.cp_placement, args.improve) == (64, "te", False)
    (args,) = parser.parse_dict({"pack_size": 64, "attention": {"backend": "math"}})  # a YAML file's dict
    assert args.attention.backend == "math"


@pytest.mark.parametrize("cp_placement", ["te", "adaptive"])
def test_the_plan_config_carries_every_packing_argument(cp_placement):
    packing = PackingArguments(
        algorithm="window", window=7, balance="tokens", cp_placement=cp_placement, cost_model="pairs"
    )
    config = packing.dataset_config(pack_size=64, overflow="split", seed=3)
    assert config.plan.fingerprint() == {
        "pack_size": 64,
        "algorithm": "window",
        "overflow": "split",
        "window": 7,
        "seed": 3,
        "cp_placement": cp_placement,
        "cost_model": "pairs",
        "improve": True,
    }
    assert (config.shuffle, config.balance) == (False, "tokens")


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


def test_resuming_with_another_cp_placement_is_refused(tmp_path):
    """The placement is part of the stream state a checkpoint saves (the PlanConfig's fingerprint)."""
    trainer = _trainer(tmp_path, args=_args(tmp_path, save_strategy="steps", save_steps=1))
    trainer.train()
    folder = tmp_path / "checkpoint-1"
    stream = read_stream_state(folder)["stream"]
    assert (stream["cp_placement"], stream["cost_model"]) == ("adaptive", "tiles")
    other = _trainer(tmp_path, packing=PackingArguments(pack_size=32, cp_placement="te"))
    with pytest.raises(ValueError, match="cp_placement: saved 'adaptive', now 'te'"):
        other.train(resume_from_checkpoint=str(folder))


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
