"""Fine-tune a tiny Llama with TRL's SFTTrainer, packed and context-parallel by thdpack, on the CPU.

    torchrun --nproc-per-node 2 examples/trl_sft_cp.py            # CP 2 over 2 processes (gloo)
    torchrun --nproc-per-node 2 examples/trl_sft_cp.py --tiny     # 3 steps (what the test runs)
    torchrun --nproc-per-node 4 examples/trl_sft_cp.py            # dp 2 x cp 2
    python examples/trl_sft_cp.py --cp-size 1                     # one process, no CP

The only change from a plain TRL script is the import of ``SFTTrainer`` (and, on CPUs, the CP size
as ``PackingArguments(cp_size=2)``: accelerate builds its ``ParallelismConfig(cp_size=...)`` mesh
only for FSDP2 on GPUs, and thdpack takes that CP size from it when it is set there). The data is
synthetic arithmetic chats (nothing is downloaded), rendered by TRL with a chat template and
trained on the assistant turns only (``assistant_only_loss=True``); the tokenizer is the GPT-2 one
thdpack ships. The loss printed per step is the exact token mean over all ranks and micro-batches.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import transformers
from datasets import Dataset

from thdpack.data.tokenizer import SHIPPED_TOKENIZERS
from thdpack.integrations.trl import PackingArguments, SFTConfig, SFTTrainer

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + eos_token }}"
    "{% endgeneration %}{% else %}{{ '### ' + m['role'] + ': ' + m['content'] + '\\n### assistant: ' }}"
    "{% endif %}{% endfor %}"
)
"""Plain-text turns (GPT-2 has no chat tokens); ``{% generation %}`` marks what the loss trains on."""


def arithmetic_chats(n: int, seed: int = 0) -> list[dict]:
    """Questions of varied length with their answers, e.g. "What is 12 plus 7?" -> "12 plus 7 is 19."."""
    rng = random.Random(seed)
    chats = []
    for _ in range(n):
        terms = [rng.randint(0, 99) for _ in range(rng.randint(2, 6))]
        spoken = " plus ".join(map(str, terms))
        question = f"What is {spoken}?" + " Please answer in one sentence." * rng.randint(0, 3)
        answer = f"{spoken} is {sum(terms)}."
        chats.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return chats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp-size", type=int, default=2, help="context-parallel size (divides the process count)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--pack-size", type=int, default=256, help="tokens per pack (SFTConfig.max_length)")
    parser.add_argument("--output-dir", default="outputs/trl_sft_cp")
    parser.add_argument("--tiny", action="store_true", help="3 steps on fewer examples (the test's run)")
    options = parser.parse_args()
    steps = 3 if options.tiny else options.steps
    start = time.perf_counter()
    torch.manual_seed(0)

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(SHIPPED_TOKENIZERS["gpt2"]), eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = transformers.LlamaForCausalLM(config)
    args = SFTConfig(
        options.output_dir,
        max_length=options.pack_size,  # the pack size
        packing=True,
        assistant_only_loss=True,
        per_device_train_batch_size=1,  # packs per micro-batch
        gradient_accumulation_steps=2,
        max_steps=steps,
        learning_rate=3e-3,
        warmup_steps=min(5, steps),
        logging_steps=1 if options.tiny else 5,
        save_strategy="steps",
        save_steps=steps,
        bf16=False,
        gradient_checkpointing=False,  # a tiny model on the CPU: recomputing costs more than it saves
        use_cpu=not torch.cuda.is_available(),
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(arithmetic_chats(64 if options.tiny else 800)),
        processing_class=tokenizer,
        packing=PackingArguments(cp_size=options.cp_size),
    )
    result = trainer.train()
    if trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        topology = trainer.topology
        print(trainer.packed_dataset.stats)
        print(
            f"trained {result.global_step} steps at dp {topology.dp_size} x cp {topology.cp_size} "
            f"({trainer.model.config._attn_implementation} attention): loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
            f"{time.perf_counter() - start:.1f} s; checkpoint {options.output_dir}/checkpoint-{result.global_step}"
        )


if __name__ == "__main__":
    main()
