"""Chat records in the tokenizer's own chat template: assistant-only masks from character offsets.

The tokenizer folders are built here, no downloads: the shipped GPT-2 byte-level BPE plus a
model's special tokens, saved by ``transformers`` with a ChatML (Qwen) or Llama-3 template.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import tokenizers
import transformers

from thdpack.data.bad_records import BadRecord
from thdpack.data.chat_template import ChatTemplate
from thdpack.data.encode import SampleEncoder, TokenizeConfig
from thdpack.data.records import record_segments
from thdpack.data.tokenizer import ASSETS, load_tokenizer

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Meta-Llama-3-8B-Instruct's template, verbatim
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6, of course."},
    ]
}
SHAREGPT = {
    "conversations": [
        {"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
        for m in CHAT["messages"]
    ]
}


def save_tokenizer_folder(path, template, special_tokens, **tokens):
    """A fast tokenizer folder as ``save_pretrained`` writes it: tokenizer.json, tokenizer_config.json,
    chat_template.jinja (GPT-2's BPE with the model's special tokens added)."""
    backend = tokenizers.Tokenizer.from_file(str(ASSETS / "gpt2_tokenizer.json"))
    backend.add_special_tokens(special_tokens)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template, **tokens)
    fast.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chatml")
    return save_tokenizer_folder(folder, CHATML, ["<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama3")
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    return save_tokenizer_folder(folder, LLAMA3, specials, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


def pieces(tokenizer, ids):
    return [tokenizer.backend.decode([i], skip_special_tokens=False) for i in ids]


def masked(tokenizer, sample):
    return [
        p for p, target in zip(pieces(tokenizer, sample.tokens.tolist()), sample.target_mask, strict=True) if target
    ]


def test_chatml_masks_exactly_the_assistant_turns_and_their_end_tokens(chatml):
    tok = load_tokenizer(chatml)
    assert tok.chat_template is not None and tok.eos_id == tok.backend.token_to_id("<|im_end|>")
    encoder = SampleEncoder(tok)
    sample = encoder.encode([CHAT])[0]
    assert "".join(pieces(tok, sample.tokens.tolist())) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n6, of course.<|im_end|>\n"
    )
    # the replies and their <|im_end|>; not the headers, not the newline between turns, no extra EOS
    assert masked(tok, sample) == ["4", "<|im_end|>", "6", ",", " of", " course", ".", "<|im_end|>"]
    assert pieces(tok, sample.tokens[-2:].tolist()) == ["<|im_end|>", "\n"]
    labels = sample.as_labels()["labels"]
    assert pieces(tok, labels[labels != -100].tolist()) == masked(tok, sample)
    assert encoder.report.chat_template == 1 and encoder.report.kinds == {"chat": 1}
    # ShareGPT's from / value renders the same conversation
    twin = encoder.encode([SHAREGPT])[0]
    assert twin.tokens.tolist() == sample.tokens.tolist()
    assert twin.target_mask.tolist() == sample.target_mask.tolist()


def test_llama3_masks_exactly_the_assistant_turns_and_eot(llama3):
    tok = load_tokenizer(llama3)
    sample = SampleEncoder(tok).encode([CHAT])[0]
    text = "".join(pieces(tok, sample.tokens.tolist()))
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>")
    assert text.count("<|begin_of_text|>") == 1  # the template's BOS, not one added by the tokenizer
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n6, of course.<|eot_id|>")
    assert masked(tok, sample) == ["4", "<|eot_id|>", "6", ",", " of", " course", ".", "<|eot_id|>"]


def test_template_from_tokenizer_config_and_named_templates(chatml, tmp_path):
    """Older folders keep the template in tokenizer_config.json, as a string or a list of named ones."""
    for i, template in enumerate(
        (CHATML, [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}])
    ):
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / "tokenizer.json").write_bytes((chatml / "tokenizer.json").read_bytes())
        config = json.loads((chatml / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
        tok = load_tokenizer(folder)
        assert tok.chat_template is not None and tok.chat_template.template == CHATML
        assert masked(tok, SampleEncoder(tok).encode([CHAT])[0])[:2] == ["4", "<|im_end|>"]


def test_a_loaded_transformers_tokenizer_brings_its_template(chatml):
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(str(chatml))
    tok = load_tokenizer(fast)
    assert tok.chat_template is not None and tok.chat_template.template == CHATML
    assert masked(tok, SampleEncoder(tok).encode([CHAT])[0])[:2] == ["4", "<|im_end|>"]


def test_without_a_template_the_plain_one_renders(chatml, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((chatml / "tokenizer.json").read_bytes())
    for spec in (tmp_path, tmp_path / "tokenizer.json"):  # a folder without a template, a bare tokenizer.json
        tok = load_tokenizer(spec)
        assert tok.chat_template is None
        sample = SampleEncoder(tok, TokenizeConfig(eos_id=tok.backend.token_to_id("<|endoftext|>"))).encode([CHAT])[0]
        plain = "".join(s.text for s in record_segments(CHAT, "chat", append_eos=False))
        assert tok.backend.decode(sample.tokens.tolist(), skip_special_tokens=False) == (
            plain.replace("### Assistant:\n4", "### Assistant:\n4<|endoftext|>") + "<|endoftext|>"
        )
    # forcing the plain template over the tokenizer's, and requiring the tokenizer's
    forced = SampleEncoder(chatml, TokenizeConfig(chat_template="plain"))
    assert forced.chat_template is None
    assert "### User:" in load_tokenizer(chatml).backend.decode(forced.encode([CHAT])[0].tokens.tolist())
    with pytest.raises(ValueError, match=r"chat_template='tokenizer' but tokenizer .* has no chat template"):
        SampleEncoder(tmp_path, TokenizeConfig(chat_template="tokenizer", append_eos=False))
    with pytest.raises(
        ValueError, match=r"unknown chat_template 'chatml'; use one of \['auto', 'tokenizer', 'plain'\]"
    ):
        TokenizeConfig(chat_template="chatml")


def test_plain_fallback_with_the_shared_gpt2_tokenizer(shared_data):
    tok = load_tokenizer(shared_data / "gpt2_tokenizer.json")
    assert tok.chat_template is None
    ours = SampleEncoder(tok).encode([CHAT])[0]
    shipped = SampleEncoder("gpt2").encode([CHAT])[0]
    assert ours.tokens.tolist() == shipped.tokens.tolist()
    assert ours.target_mask.tolist() == shipped.target_mask.tolist()
    assert tok.backend.decode(ours.tokens[ours.target_mask].tolist(), skip_special_tokens=False) == (
        "4<|endoftext|>6, of course.<|endoftext|>"
    )


def test_train_on_prompt_and_an_opening_assistant_turn(chatml):
    tok = load_tokenizer(chatml)
    everything = SampleEncoder(tok, TokenizeConfig(mask_prompt=False)).encode([CHAT])[0]
    assert everything.target_mask.all()
    # a reply with nothing before it has no prompt to render: context, not a target
    opening = {"messages": [{"role": "assistant", "content": "Hi!"}, *CHAT["messages"][1:3]]}
    sample = SampleEncoder(tok).encode([opening])[0]
    assert masked(tok, sample) == ["4", "<|im_end|>"]
    alone = SampleEncoder(tok)
    assert alone.encode([{"messages": [{"role": "assistant", "content": "Hi!"}]}]) == []
    assert alone.report.skipped_no_target == 1  # counted, not lost


def test_template_errors_are_bad_records(tmp_path):
    # Llama-2 / Mistral templates refuse conversations whose roles do not alternate
    strict = CHATML.replace(
        "{% for message in messages %}",
        "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}",
    )
    tok = load_tokenizer(
        save_tokenizer_folder(tmp_path / "strict", strict, ["<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>")
    )
    with pytest.raises(
        BadRecord, match=r"^d.jsonl line 3: the chat template of .*strict refused it: Conversation roles must alternate"
    ):
        SampleEncoder(tok).encode([CHAT], ["d.jsonl line 3"])
    skipping = SampleEncoder(tok, TokenizeConfig(on_bad_record="skip"))
    assert len(skipping.encode([CHAT, {"messages": CHAT["messages"][1:]}])) == 1
    assert skipping.bad_records.counts == {"chat_template_error": 1}


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    # earlier replies are shortened (as reasoning models drop earlier thinking): no prefix matches
    rewriting = CHATML.replace("message['content']", "(message['content'] if loop.last else message['content'][:1])")
    folder = save_tokenizer_folder(tmp_path / "rw", rewriting, ["<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>")
    encoder = SampleEncoder(folder, TokenizeConfig(on_bad_record="skip"))
    assert encoder.encode([CHAT]) == [] and encoder.bad_records.counts == {"chat_template_error": 1}
    with pytest.raises(BadRecord, match=r"renders messages\[:3\] as something other than the start of the whole"):
        SampleEncoder(folder).encode([CHAT])


def test_a_broken_template_is_an_error_not_a_bad_record(tmp_path):
    folder = save_tokenizer_folder(tmp_path / "b", "{% for m in messages %}", ["<|im_end|>"], eos_token="<|im_end|>")
    with pytest.raises(ValueError, match=r"the chat template of .* is not valid Jinja") as caught:
        SampleEncoder(folder, TokenizeConfig(on_bad_record="skip")).encode([CHAT])
    assert not isinstance(caught.value, BadRecord)


def test_missing_transformers_is_a_clear_import_error(chatml, monkeypatch):
    tok = load_tokenizer(chatml)  # reading the folder needs no transformers; rendering does
    assert SampleEncoder(tok).encode([{"text": "Hello world"}])[0].tokens.tolist() == [15496, 995, tok.eos_id]
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(
        ImportError,
        match=r"rendering the chat template of .* needs 'transformers', which is not installed; pip install 'thdpack\[hf\]'",
    ):
        SampleEncoder(tok).encode([CHAT])


def test_rendered_spans_are_character_spans(chatml):
    template = load_tokenizer(chatml).chat_template
    assert isinstance(template, ChatTemplate)
    rendered = template.render([("user", "2+2?"), ("assistant", "4")])
    assert rendered.text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    assert [rendered.text[s:e] for s, e in rendered.spans] == ["4<|im_end|>"]
    assert np.all(np.diff(np.array(rendered.spans).ravel()) >= 0)
