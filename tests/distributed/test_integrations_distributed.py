"""transformers' Trainer and TRL's SFTTrainer through thdpack's integrations on gloo ranks: dp 1 x cp 2
(2 processes), dp 2 x cp 2 and dp 1 x cp 4 (4 processes).

- Exactness: the first steps' losses and updated weights (SGD, gradient clipping, gradient
  accumulation, steps that straddle thdpack epochs) equal plain unpacked training of the same
  examples, each alone through eager transformers, fp64, to 1e-10. The Trainer's own logged loss
  (accumulated in float32 by the Trainer) agrees to 1e-6 relative. Both CP placements:
  ThdpackTrainer in Transformer Engine's layout (``cp_placement="te"``) and with the adaptive
  placement (the default) on examples whose packs hold long sequences split over a group of CP
  ranks beside short ones whole on one rank (checked: else the case proves nothing), at cp 2 and
  at cp 4 (groups of 1, 2 and 4 ranks: the placement's process groups made on every process);
  TRL's SFTTrainer with the default.
- Resume (dp 1 x cp 2): a run resumed from a mid-epoch checkpoint (the Trainer skips micro-batches)
  and from an epoch-boundary one continues with identical losses and weights, and builds no
  skipped step.
- TRL's probe at CP 2: perturb the first token of the first of two packed documents: only that
  document's positions change (accelerate's CP changes all of them: tests/unit/integrations).
- Refusals under CP: softcapping, a sliding window shorter than a sequence, an attention
  implementation thdpack cannot run on a shard; accelerate's ParallelismConfig mesh gives the same
  dp x cp layout, and a disagreeing cp_size is refused.

One launch per world size hosts every scenario (starting processes and importing TRL dominate).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("trl", reason="the TRL / Trainer integration needs thdpack[trl] (transformers, trl, accelerate)")

import torch
import torch.distributed as dist

from thdpack.cp import gather
from thdpack.testing import run_distributed
from thdpack.thd.carriage import META_KEY

from support.hf_cases import keep_float64
from support.trainer_cases import (
    MIXED_LENGTHS,
    chat_tokenizer,
    chats,
    checkpoint,
    join_launch,
    max_difference,
    placement_kinds,
    recording_classes,
    reference_run,
    sft_arguments,
    sgd,
    step_examples,
    step_losses,
    tiny_llama,
    token_examples,
    trainer_arguments,
    weights,
)

pytestmark = pytest.mark.distributed

TOL = 1e-10
CP = 2
STEPS = {2: 3, 4: 2}
"""Exactness steps per world size: enough that one step straddles two thdpack epochs (cp 2)."""
TRAINER_CASES = {
    "te": dict(lengths=None, pack_size=32, cp_size=CP, cp_placement="te"),
    "adaptive": dict(lengths=MIXED_LENGTHS, pack_size=32, cp_size=CP, cp_placement="adaptive"),
    "adaptive_cp4": dict(lengths=MIXED_LENGTHS, pack_size=48, cp_size=4, cp_placement="adaptive"),
}
"""ThdpackTrainer's exactness cases: examples (None: ``LENGTHS``) and ``PackingArguments``."""


def _exactness(trainer, examples, steps: int) -> dict:
    """Train ``steps`` steps in fp64, then compare with the unpacked reference (on every rank)."""
    initial = weights(trainer.model)
    with keep_float64():
        trainer.train()
    reference = tiny_llama(vocab_size=trainer.model.config.vocab_size)
    reference.load_state_dict(initial, strict=False)
    topology, args = trainer.topology, trainer.args
    packs_per_step = topology.dp_size * args.gradient_accumulation_steps * args.per_device_train_batch_size
    ref_losses, ref_weights = reference_run(
        reference, examples, step_examples(trainer.packed_dataset, packs_per_step, steps)
    )
    losses = step_losses(trainer)
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {
        **placement_kinds(trainer.packed_dataset, packs_per_step, steps),
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "logged": max(abs(a - b) / b for a, b in zip(logged, ref_losses, strict=True)),
        "weights": max_difference(weights(trainer.model), ref_weights),
        "moved": max_difference(weights(trainer.model), initial),
        "attention": trainer.model.config._attn_implementation,
    }


def trainer_exactness(world: int, output_dir: str, case: str) -> dict:
    from thdpack.integrations.transformers import PackingArguments

    recording, _ = recording_classes()
    settings = dict(TRAINER_CASES[case])
    lengths = settings.pop("lengths")
    model, examples = tiny_llama(), token_examples(*([lengths] if lengths else []))
    trainer = recording(
        model=model,
        args=trainer_arguments(output_dir, max_steps=STEPS[world]),
        train_dataset=examples,
        optimizers=sgd(model),
        packing=PackingArguments(**settings),
    )
    return _exactness(trainer, examples, STEPS[world])


def trl_exactness(world: int, output_dir: str) -> dict:
    from datasets import Dataset

    from thdpack.integrations.transformers import PackingArguments

    _, recording = recording_classes()
    tokenizer = chat_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer))
    trainer = recording(
        model=model,
        args=sft_arguments(output_dir, max_steps=STEPS[world]),
        train_dataset=Dataset.from_list(chats(24)),
        processing_class=tokenizer,
        optimizers=sgd(model),
        packing=PackingArguments(cp_size=CP),
    )
    examples = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    result = _exactness(trainer, examples, STEPS[world])
    result["masked"] = sum(label == -100 for ex in examples for label in ex["labels"])
    return result


def resume(output_dir: str) -> dict:
    """Four steps with a checkpoint after each; then runs resumed after step 1 and after the
    Trainer epoch's last step, each compared with the uninterrupted run."""
    from thdpack.integrations.transformers import PackingArguments

    recording, _ = recording_classes()

    def run(folder: str, resume_from: str | None = None):
        model = tiny_llama()
        trainer = recording(
            model=model,
            args=trainer_arguments(folder, max_steps=4, save_strategy="steps", save_steps=1),
            train_dataset=token_examples(),  # 2 steps per Trainer epoch: a mid-epoch and a boundary checkpoint
            optimizers=sgd(model),
            packing=PackingArguments(pack_size=32, cp_size=CP),
        )
        trainer.train(resume_from_checkpoint=resume_from)
        return trainer, [float(x) for x in trainer.micro_losses], weights(trainer.model)

    first = f"{output_dir}/uninterrupted"
    trainer, losses, final = run(first)
    micro = trainer.args.gradient_accumulation_steps
    steps_per_epoch = len(trainer.callback_handler.train_dataloader) // micro
    out = {"steps_per_epoch": steps_per_epoch}
    for done in sorted({1, steps_per_epoch}):
        _, resumed, resumed_final = run(f"{output_dir}/resumed{done}", checkpoint(first, done))
        out[done] = {
            "losses_equal": resumed == losses[done * micro :],
            "weights": max_difference(resumed_final, final),
        }
    out["files"] = sorted(p.name for p in Path(checkpoint(first, 1)).iterdir())
    return out


def probe(rank: int, output_dir: str) -> dict:
    """TRL's probe through the integration: two packed documents of 12 tokens, the first token of
    the first perturbed; which of the row's real positions change (logits gathered over CP)."""
    from datasets import Dataset

    from thdpack.integrations.transformers import PackingArguments
    from thdpack.integrations.trl import SFTTrainer

    tokenizer = chat_tokenizer()
    documents = torch.randint(3, len(tokenizer), (2, 12), generator=torch.Generator().manual_seed(1)).tolist()
    model = tiny_llama(vocab_size=len(tokenizer))
    trainer = SFTTrainer(
        model=model,
        args=sft_arguments(output_dir, max_length=32, assistant_only_loss=False, per_device_train_batch_size=1),
        train_dataset=Dataset.from_dict({"input_ids": documents}),
        processing_class=tokenizer,
        # TE's layout puts both documents' chunks on every rank (adaptive would give each its own)
        packing=PackingArguments(cp_size=CP, algorithm="sequential", cp_placement="te"),
    )
    micro = next(iter(trainer.get_train_dataloader()))
    perturbed = dict(micro, input_ids=micro["input_ids"].clone())
    if trainer.topology.cp_rank == 0:  # CP rank 0 holds the row's first chunk, so global token 0
        perturbed["input_ids"][0] = (perturbed["input_ids"][0] + 1) % model.config.vocab_size

    def row_logits(batch) -> torch.Tensor:
        with torch.no_grad(), keep_float64():
            logits_TV = model(**trainer.model_kwargs(batch)).logits[0]
        keys = ("input_ids", "cu_seqlens", "cu_seqlens_padded", "max_seqlen", META_KEY)
        return gather({**{k: batch[k] for k in keys}, "logits": logits_TV}, trainer.topology.cp_group)["logits"]

    changed_T = (row_logits(micro) - row_logits(perturbed)).abs().amax(dim=-1) > 1e-9
    cu, cu_padded = micro["cu_seqlens"].tolist(), micro["cu_seqlens_padded"].tolist()
    per_document = [int(changed_T[cu_padded[s] : cu_padded[s] + cu[s + 1] - cu[s]].sum()) for s in range(len(cu) - 1)]
    return {"lengths": [cu[s + 1] - cu[s] for s in range(len(cu) - 1)], "changed": per_document}


def refusals(output_dir: str) -> dict:
    """The messages when a model cannot be exact under CP (nothing trains)."""
    import transformers

    from thdpack.integrations.transformers import PackingArguments, ThdpackTrainer

    def custom_attention(*args, **kwargs):
        raise AssertionError("never called: the trainer refuses the model first")

    transformers.AttentionInterface.register("my_attention", custom_attention)
    small = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    models = {
        "softcap": transformers.Gemma2ForCausalLM(
            transformers.Gemma2Config(**small, num_key_value_heads=2, head_dim=8, attn_logit_softcapping=50.0)
        ),
        "window": transformers.MistralForCausalLM(
            transformers.MistralConfig(**small, num_key_value_heads=2, sliding_window=8)
        ),
        "custom": tiny_llama(implementation="my_attention"),
    }
    messages = {}
    for name, model in models.items():
        try:
            ThdpackTrainer(
                model=model,
                args=trainer_arguments(output_dir, max_steps=1),
                train_dataset=token_examples(),
                packing=PackingArguments(pack_size=32, cp_size=CP),
            )
            messages[name] = "accepted"
        except ValueError as err:
            messages[name] = str(err)
    return messages


def accelerate_layout(rank: int, world: int) -> dict:
    """``accelerator_topology`` from accelerate's own dp_shard x cp mesh (accelerate builds it only
    with FSDP2 on accelerators, so a stand-in accelerator carries the real ParallelismConfig and mesh)."""
    from accelerate import ParallelismConfig

    from thdpack.integrations.parallel import accelerator_topology

    config = ParallelismConfig(dp_shard_size=world // CP, cp_size=CP)
    accelerator = SimpleNamespace(
        num_processes=world,
        process_index=rank,
        parallelism_config=config,
        torch_device_mesh=config.build_device_mesh("cpu"),
        device=torch.device("cpu"),
    )
    topology = accelerator_topology(accelerator, None, placement_groups=False)
    try:
        accelerator_topology(accelerator, 4, placement_groups=False)
        conflict = "accepted"
    except ValueError as err:
        conflict = str(err)
    return {
        "layout": (topology.dp_size, topology.dp_rank, topology.cp_size, topology.cp_rank, topology.grad_average_size),
        "cp_members": dist.get_process_group_ranks(topology.cp_group),
        "conflict": conflict,
    }


def launch(rank: int, world: int, output_dir: str) -> dict:
    join_launch(rank, world)
    results = {
        "trainer_te": trainer_exactness(world, f"{output_dir}/trainer_te", "te"),
        "trainer_adaptive": trainer_exactness(world, f"{output_dir}/trainer_adaptive", "adaptive"),
        "trl": trl_exactness(world, f"{output_dir}/trl"),
    }
    if world == 2:  # the resume and the probe need no DP replica (the stream is the same on every rank)
        results["resume"] = resume(f"{output_dir}/resume")
        results["probe"] = probe(rank, f"{output_dir}/probe")
        results["refusals"] = refusals(f"{output_dir}/refusals")
    else:
        results["trainer_adaptive_cp4"] = trainer_exactness(world, f"{output_dir}/trainer_cp4", "adaptive_cp4")
        results["accelerate"] = accelerate_layout(rank, world)
    return results


def _launch(world: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="thdpack-trainer-") as tmp:
        return run_distributed(launch, world, tmp, timeout=600)


@pytest.fixture(scope="module")
def dp1_cp2() -> list[dict]:
    return _launch(2)


@pytest.fixture(scope="module")
def dp2_cp2() -> list[dict]:
    return _launch(4)


LAUNCHES = ["dp1_cp2", "dp2_cp2"]


EXACTNESS = [
    *((name, kind) for name in LAUNCHES for kind in ("trainer_te", "trainer_adaptive", "trl")),
    ("dp2_cp2", "trainer_adaptive_cp4"),  # its 4 processes hold dp 1 x cp 4 too
]
GROUP_SIZES = {"trainer_te": [2], "trainer_adaptive": [1, 2], "trainer_adaptive_cp4": [1, 2, 4], "trl": [1]}
"""The CP group sizes of the trained sequences: TE's layout splits every one over all CP ranks; the
mixed examples' adaptive packs put short ones whole and long ones over groups (cp 4: of 2 and 4 ranks);
TRL's short chats all go whole."""


@pytest.mark.parametrize(("launch_name", "kind"), EXACTNESS)
def test_steps_equal_unpacked_training(request, launch_name, kind):
    results = request.getfixturevalue(launch_name)
    for rank, result in enumerate(results):
        found = result[kind]
        assert found["group_sizes"] == GROUP_SIZES[kind], f"{kind}, {launch_name}: {found}"
        if kind.startswith("trainer_adaptive"):
            assert found["mixed_packs"] > 0, f"{kind}: no pack holds whole and split sequences, which proves nothing"
        assert found["attention"] == "thdpack", f"{kind}, rank {rank}: CP needs thdpack's attention"
        assert found["moved"] > 1e-3, f"{kind}: the weights did not change, so the comparison proves nothing"
        assert found["loss"] <= TOL and found["weights"] <= TOL, f"{kind}, {launch_name}, rank {rank}: {found}"
        assert found["logged"] <= 1e-6, f"{kind}, {launch_name}, rank {rank}: the Trainer's logged loss {found}"
    assert results[0]["trl"]["masked"] > 0, "assistant_only_loss masked no token"


def test_resume_continues_the_same_pack_stream(dp1_cp2):
    for rank, result in enumerate(dp1_cp2):
        found = result["resume"]
        assert 1 < found["steps_per_epoch"] < 4, f"no mid-epoch and boundary resume both: {found}"
        for done in (1, found["steps_per_epoch"]):
            assert found[done]["losses_equal"], f"rank {rank}, resumed after step {done}: other losses"
            assert found[done]["weights"] == 0.0, f"rank {rank}, resumed after step {done}: {found[done]}"
        assert "thdpack_stream.json" in found["files"]


def test_probe_changes_only_the_perturbed_document(dp1_cp2):
    for result in dp1_cp2:
        assert result["probe"] == {"lengths": [12, 12], "changed": [12, 0]}, result["probe"]


def test_refusals_under_cp(dp1_cp2):
    messages = dp1_cp2[0]["refusals"]
    assert "softcaps its attention scores (config.attn_logit_softcapping=50.0)" in messages["softcap"]
    assert "config.sliding_window=8 is shorter than sequence 0 of the batch (15 tokens)" in messages["window"]
    assert "the model's attention 'my_attention' cannot run a CP shard" in messages["custom"]


def test_accelerate_parallelism_config_gives_the_same_layout(dp2_cp2):
    for rank, result in enumerate(dp2_cp2):
        found = result["accelerate"]
        assert found["layout"] == (2, rank // 2, 2, rank % 2, 4)
        assert found["cp_members"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert "PackingArguments(cp_size=4) disagrees with ParallelismConfig(cp_size=2)" in found["conflict"]
