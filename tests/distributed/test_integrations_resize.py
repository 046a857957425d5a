"""The Trainer integrations resumed at another world size: gloo ranks, fp64, tiny Llamas.

- ``ThdpackTrainer``: 2 processes (dp 2, 1 micro-batch a step) save a checkpoint after every step;
  1 process (2 micro-batches) resumes from step 2. The packs per step stay 2, so the resumed steps'
  losses and the final weights equal the uninterrupted run's (to 1e-10: the reduction order differs).
- TRL's ``SFTTrainer`` the other way: 1 process (2 micro-batches) -> 2 processes (1 each).
"""

from __future__ import annotations

import tempfile

import pytest

pytest.importorskip("trl", reason="the TRL / Trainer integration needs thdpack[trl] (transformers, trl, accelerate)")

from thdpack.testing import run_distributed

from support import trainer_cases as cases
from support.hf_cases import keep_float64

pytestmark = pytest.mark.distributed
TOL = 1e-10
STEPS = 4
RESUME_AT = 2


def train(rank: int, world: int, kind: str, output_dir: str, resume_from: str | None) -> dict:
    """``STEPS`` steps of ``kind`` (``"trainer"`` or ``"trl"``) with the same packs per step at
    every world size (2 micro-batches on 1 process, 1 on 2), a checkpoint after each."""
    from datasets import Dataset

    from thdpack.integrations.transformers import PackingArguments

    cases.join_launch(rank, world)
    trainer_kind, sft_kind = cases.recording_classes()
    every_step = dict(max_steps=STEPS, save_strategy="steps", save_steps=1, gradient_accumulation_steps=2 // world)
    if kind == "trainer":
        model = cases.tiny_llama()
        trainer = trainer_kind(
            model=model,
            args=cases.trainer_arguments(output_dir, **every_step),
            train_dataset=cases.token_examples(),
            optimizers=cases.sgd(model),
            packing=PackingArguments(pack_size=32),
        )
    else:
        tokenizer = cases.chat_tokenizer()
        model = cases.tiny_llama(vocab_size=len(tokenizer))
        trainer = sft_kind(
            model=model,
            args=cases.sft_arguments(output_dir, **every_step),
            train_dataset=Dataset.from_list(cases.chats(24)),
            processing_class=tokenizer,
            optimizers=cases.sgd(model),
        )
    with keep_float64():
        trainer.train(resume_from_checkpoint=resume_from)
    return {
        "losses": cases.step_losses(trainer),
        "weights": cases.weights(trainer.model),
        "step": trainer.state.global_step,
    }


def resized(kind: str, before: int, after: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="thdpack-resize-") as tmp:
        straight = run_distributed(train, before, kind, f"{tmp}/straight", None, timeout=600)[0]
        resumed = run_distributed(train, after, kind, f"{tmp}/resumed", cases.checkpoint(f"{tmp}/straight", RESUME_AT),
                                  timeout=600)[0]  # fmt: skip
    return {
        "steps": resumed["step"],
        "losses": max(abs(a - b) for a, b in zip(resumed["losses"], straight["losses"][RESUME_AT:], strict=True)),
        "weights": cases.max_difference(resumed["weights"], straight["weights"]),
        "moved": len(resumed["losses"]) == STEPS - RESUME_AT,
    }


@pytest.mark.parametrize(
    ("kind", "before", "after"), [("trainer", 2, 1), ("trl", 1, 2)], ids=["trainer-2to1", "trl-1to2"]
)
def test_a_resume_at_another_world_size_continues_the_same_steps(kind, before, after):
    found = resized(kind, before, after)
    assert found["steps"] == STEPS and found["moved"], found
    assert found["losses"] <= TOL and found["weights"] <= TOL, found
