"""The stores of issue 17's reports: 300 short text records (6 to 140 GPT-2 tokens), as
``thdpack prepare`` writes them, and the overrides of its "T" command."""

from __future__ import annotations

import json
import random
from pathlib import Path

from test_train import TINY

from thdpack.data.write_store import write_token_store

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]
T = [*TINY, "train.micro_batches=1"]
"""The tiny model on 256-token packs (cp 2 under torchrun), one pack per rank and step."""


def write_short_store(folder: Path, *, seed: int) -> Path:
    """A token store of 300 records of 5 to 80 words; another ``seed``, other records (same count)."""
    rng = random.Random(seed)
    records = folder.with_suffix(".jsonl")
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 80)))}) for _ in range(300)]
    records.write_text("\n".join(lines) + "\n")
    write_token_store([str(records)], folder, tokenizer="gpt2", verbose=False)
    return folder
