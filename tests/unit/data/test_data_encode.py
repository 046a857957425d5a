"""Tokenization: the shipped GPT-2 tokenizer, EOS, SFT masks written out, both sample formats, errors."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import numpy as np
import pytest
import tokenizers

from thdpack.data.encode import SampleEncoder, TokenizeConfig, TokenizedSample, tokenize_records
from thdpack.data.records import detect_kind, record_segments
from thdpack.data.tokenizer import ASSETS, load_tokenizer

GPT2_SHA256 = "e88dafdf79f2026eaffb161c36a8b914b5fa586a620d108b9fecc117f74dbdd7"
EOS = 50256
# "Below is an instruction that describes a task. Write a response that appropriately completes
# the request.\n\n### Instruction:\nAdd 2 and 3.\n\n### Response:\n" in GPT-2 tokens
ALPACA_PROMPT_IDS = [
    21106, 318, 281, 12064, 326, 8477, 257, 4876, 13, 19430, 257, 2882, 326, 20431, 32543, 262, 2581,
    13, 198, 198, 21017, 46486, 25, 198, 4550, 362, 290, 513, 13, 198, 198, 21017, 18261, 25, 198,
]  # fmt: skip


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


def test_shipped_gpt2_round_trip(gpt2):
    assert gpt2.encode_batch(["Hello world", ""]) == [[15496, 995], []]
    assert (gpt2.name, gpt2.vocab_size, gpt2.eos_id, gpt2.sha256) == ("gpt2", 50257, EOS, GPT2_SHA256)
    assert gpt2.backend.decode([15496, 995]) == "Hello world"
    assert hashlib.sha256((ASSETS / "gpt2_tokenizer.json").read_bytes()).hexdigest() == GPT2_SHA256
    assert (ASSETS / "licenses" / "gpt-neox_LICENSE.txt").is_file()
    assert (ASSETS / "licenses" / "openai_gpt-2_LICENSE.txt").is_file()


def test_text_gets_eos_and_shifted_labels(gpt2):
    sample = SampleEncoder(gpt2).encode([{"text": "Hello world"}])[0]
    assert sample.tokens.tolist() == [15496, 995, EOS]
    assert sample.as_labels()["input_ids"].tolist() == [15496, 995]
    assert sample.as_labels()["labels"].tolist() == [995, EOS]
    assert sample.as_loss_mask()["input_ids"].tolist() == [15496, 995, EOS]
    assert sample.as_loss_mask()["loss_mask"].tolist() == [1, 1, 0]
    no_eos = SampleEncoder(gpt2, TokenizeConfig(append_eos=False)).encode([{"text": "Hello world"}])
    assert no_eos[0].as_labels()["labels"].tolist() == [995]


def test_alpaca_prompt_is_masked_written_out(gpt2):
    record = {"instruction": "Add 2 and 3.", "input": "", "output": "5"}
    sample = SampleEncoder(gpt2).encode([record])[0]
    assert sample.tokens.tolist() == [*ALPACA_PROMPT_IDS, 20, EOS]  # "5" is token 20
    assert sample.target_mask.tolist() == [False] * 35 + [True, True]
    out = sample.as_labels()
    assert out["input_ids"].tolist() == [*ALPACA_PROMPT_IDS, 20]
    # labels[t] is the target for input_ids[t]: only the response "5" and EOS are learned
    assert out["labels"].tolist() == [-100] * 34 + [20, EOS]
    assert sample.as_loss_mask()["loss_mask"].tolist() == [0] * 34 + [1, 1, 0]
    trained = SampleEncoder(gpt2, TokenizeConfig(mask_prompt=False)).encode([record])[0]
    assert trained.as_labels()["labels"].tolist() == [*ALPACA_PROMPT_IDS[1:], 20, EOS]


def test_alpaca_with_input_uses_the_input_prompt():
    segments = record_segments({"instruction": "Sum.", "input": "2 3", "output": "5"}, "alpaca")
    assert segments[0].text.endswith("### Instruction:\nSum.\n\n### Input:\n2 3\n\n### Response:\n")
    assert segments[0].text.startswith("Below is an instruction that describes a task, paired with an input")
    assert (segments[1].text, segments[1].target, segments[1].eos) == ("5", True, True)


def test_chat_assistant_turns_are_targets(gpt2):
    chat = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": "6"},
        ]
    }
    sample = SampleEncoder(gpt2).encode([chat])[0]
    labels = sample.as_labels()["labels"]
    targets = labels[labels != -100].tolist()
    assert targets == [19, EOS, 21, EOS]  # "4" <eos> "6" <eos>
    assert gpt2.backend.decode(sample.tokens[: np.flatnonzero(sample.target_mask)[0]].tolist()) == (
        "### System:\nBe brief.\n\n### User:\n2+2?\n\n### Assistant:\n"
    )
    sharegpt = {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}
    openai = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    encoder = SampleEncoder(gpt2)
    a, b = encoder.encode([sharegpt, openai])
    assert a.tokens.tolist() == b.tokens.tolist() and a.target_mask.tolist() == b.target_mask.tolist()


def test_sample_formats_train_the_same_targets(gpt2):
    """Both formats give the same (position, target) pairs once next-token labels are derived."""
    sample = SampleEncoder(gpt2).encode([{"instruction": "Say hi.", "output": "Hi there!"}])[0]
    by_labels = sample.as_labels()
    by_mask = sample.as_loss_mask()
    derived = np.append(by_mask["input_ids"][1:], -100)
    derived[by_mask["loss_mask"] == 0] = -100
    assert derived[:-1].tolist() == by_labels["labels"].tolist()
    with pytest.raises(ValueError, match=r"unknown sample_format 'bshd'; use one of \['labels', 'loss_mask'\]"):
        sample.to_sample("bshd")


def test_skips_are_counted_not_silent(gpt2):
    encoder = SampleEncoder(gpt2, TokenizeConfig(append_eos=False))
    out = encoder.encode([{"text": "Hi"}, {"text": "Hello world"}, {"instruction": "q", "output": ""}])
    assert [s.tokens.tolist() for s in out] == [[15496, 995]]
    report = encoder.report
    assert (report.records, report.samples, report.skipped_too_short, report.skipped_no_target) == (
        3,
        1,
        1,
        1,
    )
    assert report.kinds == {"text": 2, "alpaca": 1}
    assert "skipped 1 too short (< 2 tokens), 1 without targets, 0 bad" in str(report)


def test_streaming_batches_equal_one_batch(gpt2):
    records = [{"text": f"document number {i} " * (i % 4 + 1)} for i in range(7)]
    streamed = list(tokenize_records(records, gpt2, TokenizeConfig(batch_size=2), progress=False))
    whole = SampleEncoder(gpt2).encode(records)
    assert [s.tokens.tolist() for s in streamed] == [s.tokens.tolist() for s in whole]
    broken = [*records[:3], {"body": "no text"}, *records[3:]]
    with pytest.raises(ValueError, match=r"^record 3: has keys \['body'\]"):  # counted across batches
        list(tokenize_records(broken, gpt2, TokenizeConfig(batch_size=2), progress=False))


def test_other_tokenizers_paths_objects_and_errors(tmp_path, gpt2):
    word = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    word.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    word.save(str(tmp_path / "tokenizer.json"))
    for spec in (tmp_path / "tokenizer.json", tmp_path, str(tmp_path)):
        loaded = load_tokenizer(spec)
        assert loaded.encode_batch(["a b c"]) == [[0, 1, 2]] and loaded.eos_id is None
    assert load_tokenizer(word).sha256 == hashlib.sha256(word.to_str().encode()).hexdigest()
    with pytest.raises(ValueError, match=r"none of the EOS tokens .* pass eos_id= \(--eos-id\) or append_eos=False"):
        SampleEncoder(word)
    assert SampleEncoder(word, TokenizeConfig(eos_id=2)).encode([{"text": "a b"}])[0].tokens.tolist() == [
        0,
        1,
        2,
    ]
    with pytest.raises(ValueError, match=r"eos_id=7 is outside the vocabulary \(size 3\)"):
        SampleEncoder(word, TokenizeConfig(eos_id=7))
    # a fast transformers tokenizer is used through its backend_tokenizer and eos_token_id
    fast = SimpleNamespace(backend_tokenizer=gpt2.backend, eos_token_id=EOS, name_or_path="openai-community/gpt2")
    assert load_tokenizer(fast).name == "openai-community/gpt2"
    assert load_tokenizer(fast).encode_batch(["Hello world"]) == [[15496, 995]]
    with pytest.raises(ValueError, match=r"tokenizer 'gpt3' is neither a shipped one \(\['gpt2'\]\)"):
        load_tokenizer("gpt3")
    (tmp_path / "broken.json").write_text('{"model": 1}')
    with pytest.raises(ValueError, match=r"cannot read .*broken.json as a Hugging Face tokenizer.json"):
        load_tokenizer(tmp_path / "broken.json")
    with pytest.raises(TypeError, match="cannot use a int as a tokenizer"):
        load_tokenizer(3)


def test_record_errors_name_the_record(gpt2):
    encoder = SampleEncoder(gpt2)
    with pytest.raises(ValueError, match=r"d.jsonl line 4: has keys \['body', 'id'\]; expected 'text' \(text\)"):
        encoder.encode([{"body": "x", "id": 1}], ["d.jsonl line 4"])
    with pytest.raises(
        ValueError, match=r"record 0: message 0 has role='tool'; use one of \['system', 'user', 'assistant'\]"
    ):
        encoder.encode([{"messages": [{"role": "tool", "content": "x"}]}])
    with pytest.raises(ValueError, match=r"record 0: has no field 'output' \(its keys: \['instruction', 'text'\]\)"):
        SampleEncoder(gpt2, TokenizeConfig(kind="alpaca")).encode([{"instruction": "x", "text": "y"}])
    with pytest.raises(ValueError, match=r"field 'output' must be a string, got int"):
        encoder.encode([{"instruction": "x", "output": 5}])
    with pytest.raises(
        ValueError, match=r"unknown record kind 'code'; use one of \['auto', 'text', 'alpaca', 'chat'\]"
    ):
        TokenizeConfig(kind="code")
    assert detect_kind({"content": "x"}, text_key="content") == "text"


def test_tokenized_sample_is_plain_data():
    sample = TokenizedSample(np.array([5, 6, 7]), np.array([False, True, True]))
    assert sample.as_labels()["labels"].tolist() == [6, 7]
