"""Sources and the shipped tokenizer reproduce the reference lengths in ../shared/data.

Alpaca (CC BY-NC 4.0) is read in place from ../shared/data and never copied into the repository.
"""

from __future__ import annotations

import itertools
import sys

import numpy as np
import pytest

from thdpack.data.encode import SampleEncoder
from thdpack.data.sources import Source, stdlib_root
from thdpack.data.tokenizer import load_tokenizer


def test_alpaca_json_streams_and_tokenizes_like_the_reference(shared_data):
    source = Source(shared_data / "alpaca_data.json")
    records = list(source)
    assert source.format == "json" and len(records) == 52002 and source.report.skipped_empty == 0
    reference = np.load(shared_data / "alpaca_data.gpt2.lengths.npy")
    # the reference text is "\n\n".join(non-empty of instruction, input, output), no special tokens
    head = records[:2000]
    texts = ["\n\n".join(r[k] for k in ("instruction", "input", "output") if r[k]) for r in head]
    lengths = [len(ids) for ids in load_tokenizer("gpt2").encode_batch(texts)]
    assert lengths == reference[:2000].tolist()


def test_alpaca_sft_masks_every_prompt(shared_data):
    records = list(itertools.islice(Source(shared_data / "alpaca_data.json"), 500))
    encoder = SampleEncoder("gpt2")
    samples = encoder.encode(records)
    assert len(samples) == 500 and encoder.report.kinds == {"alpaca": 500}
    for sample in samples:
        labels = sample.as_labels()["labels"]
        first_target = int(np.flatnonzero(labels != -100)[0])
        assert first_target > 20  # the prompt template alone is longer than 20 tokens
        assert (labels[first_target:] != -100).all() and labels[-1] == 50256


def test_stdlib_corpus_matches_the_reference_file_list_and_lengths(shared_data):
    header, *files = (shared_data / "python311_stdlib.files.txt").read_text().splitlines()
    if f"(Python {sys.version.split()[0]})" not in header or not header.startswith(f"# {stdlib_root()} "):
        pytest.skip(f"the reference lists another interpreter's stdlib: {header}")
    reference = np.load(shared_data / "python311_stdlib.gpt2.lengths.npy")
    source = Source("stdlib")
    records = list(source)
    non_empty = [f for f, n in zip(files, reference, strict=True) if n > 0]
    assert [r["path"] for r in records] == non_empty  # same files, same order
    assert source.report.skipped_empty == int((reference == 0).sum()) == 28
    assert source.report.decode_replaced == 4  # test files that are deliberately not UTF-8
    # token counts of the small files and of the four repaired ones (cheap; the whole corpus takes ~20 s)
    repaired = {"test/test_source_encoding.py", "test/encoded_modules/module_koi8_r.py"}
    picked = [i for i, r in enumerate(records) if len(r["text"]) < 2000 or r["path"] in repaired]
    assert len(picked) > 300
    texts = [records[i]["text"] for i in picked]
    lengths = [len(ids) for ids in load_tokenizer("gpt2").encode_batch(texts)]
    assert lengths == reference[reference > 0][picked].tolist()
