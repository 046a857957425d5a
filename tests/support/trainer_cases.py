"""transformers' Trainer and TRL's SFTTrainer through ``thdpack.integrations``, on gloo ranks, against
plain unpacked training: tiny random fp64 Llamas and a word-level chat tokenizer built here
(nothing downloaded), and a single-process reference that runs every example alone through
eager transformers and takes the optimizer step by hand.

Needs transformers, TRL and accelerate: import after ``pytest.importorskip("trl")``.

Which examples a step trains on comes from the plan, as ``PackedDataset.step_stream`` documents
it: the epochs' pack orders one after the other, ``packs_per_step`` packs per step.

Legend: ``T`` tokens of an example, ``V`` vocabulary.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

from thdpack.packing.dataset import PackedDataset

from support.hf_cases import keep_float64

LLAMA = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
VOCAB = 97
LENGTHS = (13, 1, 4, 9, 2, 15, 8, 6, 3, 11, 5, 7, 12, 10)
"""Examples of the Trainer runs: a length 1 (no target), CP-padded lengths, every third with a masked prompt."""
MIXED_LENGTHS = (*LENGTHS, 22, 27, 3, 2, 6)
"""``LENGTHS`` and two long examples: an adaptive CP placement at cp 2 with packs of 32 (cp 4: 48)
splits the long ones over a group of CP ranks beside short ones whole on one rank in the same pack."""
LR, CLIP = 0.5, 1.0
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + eos_token }}"
    "{% endgeneration %}{% else %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
)
"""A chat template with generation markers, so TRL's ``assistant_only_loss`` finds the replies."""
WORDS = ["the", "cat", "sat", "on", "a", "warm", "mat", "while", "two", "small", "dogs", "ran", "far", "away"]


def join_launch(rank: int, world: int) -> None:
    """The environment accelerate reads to see a launched run (``run_distributed`` made the group)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")


def cpu_arguments(kind: type, output_dir: str | Path, **settings: Any) -> Any:
    """``kind`` (``transformers.TrainingArguments`` or TRL's ``SFTConfig``) for a quiet test run on
    the CPU in ``output_dir``: no reports, checkpoints or progress bars, no bf16 (the models are
    fp64), then ``settings``."""
    quiet = {"report_to": [], "save_strategy": "no", "use_cpu": True, "disable_tqdm": True, "bf16": False}
    return kind(str(output_dir), **{**quiet, **settings})


def tiny_llama(vocab_size: int = VOCAB, implementation: str = "eager", **extra: Any) -> transformers.PreTrainedModel:
    """A float64 Llama of ``LLAMA``'s sizes, the same weights on every rank."""
    config = transformers.LlamaConfig(vocab_size=vocab_size, pad_token_id=0, **LLAMA, **extra)
    config._attn_implementation = implementation
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


def token_examples(lengths: Sequence[int] = LENGTHS, seed: int = 0) -> list[dict[str, list[int]]]:
    """Hugging Face examples: ``input_ids`` and aligned ``labels``, -100 on a prompt (first third)
    of every third example."""
    rng = np.random.default_rng(seed)
    examples = []
    for i, n in enumerate(lengths):
        ids = rng.integers(1, VOCAB, n).tolist()
        labels = [-100 if i % 3 == 2 and t < n // 3 else token for t, token in enumerate(ids)]
        examples.append({"input_ids": ids, "labels": labels})
    return examples


def chat_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer of ``WORDS`` (a vocabulary of 22, so fp64 runs stay fast), with
    ``CHAT_TEMPLATE``; its character offsets give TRL the assistant masks."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {word: i for i, word in enumerate(["<pad>", "<unk>", "</s>", "user", "assistant", ":", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def chats(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Conversations of one user turn and one reply, of varied lengths."""
    rng = np.random.default_rng(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS, int(rng.integers(lo, hi))))

    return [
        {"messages": [{"role": "user", "content": text(1, 8)}, {"role": "assistant", "content": text(1, 10)}]}
        for _ in range(n)
    ]


def recording_classes() -> tuple[type, type]:
    """``ThdpackTrainer`` and TRL's ``SFTTrainer`` through thdpack, each recording its micro-batch losses."""
    from thdpack.integrations.transformers import ThdpackTrainer
    from thdpack.integrations.trl import SFTTrainer

    return type("RecordingTrainer", (RecordLosses, ThdpackTrainer), {}), type(
        "RecordingSFTTrainer", (RecordLosses, SFTTrainer), {}
    )


STEP = dict(gradient_accumulation_steps=2, logging_steps=1, max_grad_norm=CLIP, seed=0)
"""One step: two micro-batches, clipped, logged, seeded."""


def trainer_arguments(output_dir: str | Path, **overrides: Any) -> transformers.TrainingArguments:
    """``TrainingArguments`` of a ``STEP`` with one pack per micro-batch, then ``overrides``."""
    settings = {**STEP, "per_device_train_batch_size": 1, **overrides}
    return cpu_arguments(transformers.TrainingArguments, output_dir, **settings)


def sft_arguments(output_dir: str | Path, **overrides: Any) -> Any:
    """TRL's ``SFTConfig`` of a ``STEP`` on 64-token packs, two a micro-batch, assistant-only loss."""
    from thdpack.integrations.trl import SFTConfig

    # keep_float64's torch-function mode does not reach checkpointing's recompute in backward
    sft = dict(max_length=64, assistant_only_loss=True, per_device_train_batch_size=2, gradient_checkpointing=False)
    return cpu_arguments(SFTConfig, output_dir, **{**STEP, **sft, **overrides})


def sgd(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """Plain SGD at a constant ``LR``: the updated weights show the step's gradient directly."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


class RecordLosses:
    """Mixin for a thdpack trainer: keeps every micro-batch's loss (this rank's share of the step's loss)."""

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.micro_losses = [*getattr(self, "micro_losses", []), loss.detach().clone()]
        return loss


def step_losses(trainer: Any) -> list[float]:
    """Each step's global loss: the micro-batch shares summed over the step and over the ranks,
    divided by the ranks the gradients were averaged over (the trainer's ``grad_average_size``)."""
    per_micro = torch.stack(trainer.micro_losses).reshape(-1, trainer.args.gradient_accumulation_steps)
    total = per_micro.sum(dim=1)
    dist.all_reduce(total)
    return (total / trainer.topology.grad_average_size).tolist()


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def step_packs(dataset: PackedDataset, packs_per_step: int, steps: int) -> list[tuple[int, int]]:
    """``(epoch, pack)`` of every pack of the first ``steps`` steps, in stream order (all DP ranks together)."""
    refs: list[tuple[int, int]] = []
    epoch = 0
    while len(refs) < steps * packs_per_step:
        refs += [(epoch, int(i)) for i in dataset.epochs[epoch].order]
        epoch += 1
    return refs[: steps * packs_per_step]


def placement_kinds(dataset: PackedDataset, packs_per_step: int, steps: int) -> dict[str, Any]:
    """The CP group sizes of the sequences the first ``steps`` steps train on, and how many of
    their packs hold a sequence whole on one CP rank beside one split over a group of ranks (none
    without a placement: every sequence is split over all ranks)."""
    sizes: set[int] = set()
    mixed = 0
    for epoch, pack in step_packs(dataset, packs_per_step, steps):
        placement = dataset.epochs[epoch].plan.placement
        size_S = placement.pack(pack).group_size_S if placement is not None else np.array([dataset.runtime.cp_size])
        sizes |= set(size_S.tolist())
        mixed += int((size_S == 1).any() and (size_S > 1).any())
    return {"group_sizes": sorted(sizes), "mixed_packs": mixed}


def step_examples(dataset: PackedDataset, packs_per_step: int, steps: int) -> list[list[int]]:
    """The example indices of each of the first ``steps`` steps (all DP ranks together)."""
    refs = step_packs(dataset, packs_per_step, steps)
    out = []
    for k in range(steps):
        indices = []
        for epoch, pack in refs[k * packs_per_step : (k + 1) * packs_per_step]:
            segment, starts, _ = dataset.epochs[epoch].plan.segments(pack)
            assert not starts.any(), "the reference takes whole examples"
            indices += segment.tolist()
        out.append(indices)
    return out


def reference_run(
    model: torch.nn.Module, examples: Sequence[Mapping[str, Any]], steps: Sequence[Sequence[int]]
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Unpacked training: every example of a step alone through plain eager transformers, the
    token-mean loss over the step's examples, gradient clipping at ``CLIP``, an SGD step.
    Returns the step losses and the final weights."""
    optimizer, _ = sgd(model)
    losses = []
    for indices in steps:
        optimizer.zero_grad(set_to_none=True)
        total, count = torch.zeros((), dtype=torch.float64), 0
        with keep_float64():
            for i in indices:
                ids = torch.as_tensor(examples[i]["input_ids"], dtype=torch.long)[None]
                targets_T = torch.as_tensor(examples[i]["labels"], dtype=torch.long)[1:]
                logits_TV = model(input_ids=ids, use_cache=False).logits[0, :-1]
                total = total + F.cross_entropy(logits_TV, targets_T, ignore_index=-100, reduction="sum")
                count += int((targets_T != -100).sum())
            loss = total / count
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, weights(model)


def max_difference(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def checkpoint(output_dir: str | Path, step: int) -> str:
    return str(Path(output_dir) / f"checkpoint-{step}")
