"""Bad records: every reason fails naming the record by default, or is skipped, counted and logged."""

from __future__ import annotations

import json

import pytest

from thdpack.data.bad_records import BadRecord, BadRecords, RecordOrigin
from thdpack.data.encode import SampleEncoder, TokenizeConfig
from thdpack.data.records import chat_messages
from thdpack.data.sources import Source

GOOD = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
# (record, reason, message) for every way a record can fail to be a sample
BAD = [
    ({"id": "a", "conversations": []}, "empty_conversation", "'conversations' is empty: no messages to train on"),
    (
        {"conversations": [{"from": "human", "value": "hi"}]},
        "no_assistant_turn",
        "has no 'gpt' message to train on (its roles: ['human'])",
    ),
    (
        {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}]},
        "unknown_role",
        "message 1 has role='tool'; use one of ['system', 'user', 'assistant']",
    ),
    (
        {"conversations": [{"from": "human", "value": "q"}, {"from": "bing", "value": "x"}]},
        "unknown_role",
        "message 1 has from='bing'; use one of ['system', 'human', 'gpt']",
    ),
    ({"messages": "hi"}, "wrong_type", "'messages' must be a list, got str"),
    (
        {"messages": [{"role": "assistant"}]},
        "missing_field",
        "message 0 has no field 'content'; it must be a string (its keys: ['role'])",
    ),
    ({"body": "x"}, "unknown_kind", "has keys ['body']; expected 'text' (text)"),
    ({"instruction": "x", "output": 5}, "wrong_type", "field 'output' must be a string, got int"),
]


@pytest.mark.parametrize(("record", "reason", "message"), BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_fail_names_the_record_the_problem_and_the_fix(record, reason, message):
    encoder = SampleEncoder("gpt2")
    with pytest.raises(BadRecord) as caught:
        encoder.encode([GOOD, record], ["d.jsonl line 1", "d.jsonl line 2"])
    assert caught.value.reason == reason
    text = str(caught.value)
    assert text.startswith(f"d.jsonl line 2: {message}")
    assert text.endswith("pass on_bad_record='skip' (--on-bad-record skip) to skip such records; they are "
                         "counted per reason and listed in skipped_records.jsonl")  # fmt: skip


def test_skip_counts_per_reason_and_keeps_the_good_records(tmp_path):
    with BadRecords("skip", log=tmp_path / "skipped.jsonl") as bad:
        encoder = SampleEncoder("gpt2", TokenizeConfig(on_bad_record="skip"), bad_records=bad)
        records = [GOOD, *(record for record, _, _ in BAD), GOOD]
        origins = [RecordOrigin("d.jsonl", line=i + 1) for i in range(len(records))]
        samples = encoder.encode(records, origins)
    assert len(samples) == 2
    report = encoder.report
    assert (report.records, report.samples, report.skipped_bad) == (10, 2, 8)
    assert report.records == report.samples + report.skipped_too_short + report.skipped_no_target + report.skipped_bad
    assert bad.counts == {
        "empty_conversation": 1,
        "no_assistant_turn": 1,
        "unknown_role": 2,
        "wrong_type": 2,
        "missing_field": 1,
        "unknown_kind": 1,
    }
    assert bad.summary() == {
        "policy": "skip",
        "total": 8,
        "by_reason": dict(sorted(bad.counts.items())),
        "file": "skipped.jsonl",
    }
    logged = [json.loads(line) for line in (tmp_path / "skipped.jsonl").read_text().splitlines()]
    assert [(e["line"], e["reason"]) for e in logged] == [(i + 2, reason) for i, (_, reason, _) in enumerate(BAD)]
    assert logged[0] == {
        "origin": "d.jsonl line 2",
        "path": "d.jsonl",
        "line": 2,
        "reason": "empty_conversation",
        "message": "'conversations' is empty: no messages to train on",
    }
    assert "skipped 8 bad records (empty_conversation 1, missing_field 1, no_assistant_turn 1" in str(bad)


def test_skip_without_a_log_only_counts(tmp_path):
    encoder = SampleEncoder("gpt2", TokenizeConfig(on_bad_record="skip"))
    assert encoder.encode([BAD[0][0], GOOD]) and encoder.bad_records.counts == {"empty_conversation": 1}
    assert encoder.bad_records.summary()["file"] is None
    with pytest.raises(ValueError, match=r"unknown on_bad_record 'drop'; use one of \['fail', 'skip'\]"):
        TokenizeConfig(on_bad_record="drop")
    with pytest.raises(ValueError, match=r"unknown on_bad_record 'drop'; use one of \['fail', 'skip'\]"):
        BadRecords("drop")


def test_the_log_exists_only_when_something_was_skipped(tmp_path):
    with BadRecords("skip", log=tmp_path / "skipped.jsonl") as bad:
        SampleEncoder("gpt2", bad_records=bad).encode([GOOD])
    assert not (tmp_path / "skipped.jsonl").exists() and bad.summary()["file"] is None


def test_chat_messages_normalises_both_shapes():
    sharegpt = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}]}
    sharegpt["conversations"].append({"from": "gpt", "value": "a"})
    assert chat_messages(sharegpt) == [("system", "s"), ("user", "q"), ("assistant", "a")]
    assert chat_messages(GOOD) == [("user", "2+2?"), ("assistant", "4")]


def test_sources_skip_lines_that_are_not_json_objects(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"\n[1, 2]\n{"text": "c"}\n')
    with pytest.raises(BadRecord, match=r"d.jsonl line 2: malformed JSON: Expecting ',' delimiter"):
        list(Source(path))
    bad = BadRecords("skip", log=tmp_path / "skipped.jsonl")
    source = Source(path, bad_records=bad)
    assert list(source) == [{"text": "a"}, {"text": "c"}]
    bad.close()
    assert (source.report.records, source.report.skipped_bad) == (2, 2)
    assert str(source.report) == "2 records, 0 empty skipped, 2 bad skipped"
    assert bad.counts == {"malformed_json": 1, "not_an_object": 1}
    logged = [json.loads(line) for line in (tmp_path / "skipped.jsonl").read_text().splitlines()]
    assert [(e["line"], e["reason"], e["message"]) for e in logged] == [
        (2, "malformed_json", "malformed JSON: Expecting ',' delimiter (column 13)"),
        (3, "not_an_object", "expected a JSON object (a mapping), got list"),
    ]


def test_origins_carry_their_parts(tmp_path):
    array = tmp_path / "d.json"
    array.write_text('[\n{"text": "a"},\n{"text": "b"}\n]')
    origins = [origin for origin, _ in Source(array).records_with_origin()]
    assert origins == [f"{array} record 0 (line 2)", f"{array} record 1 (line 3)"]
    assert origins[1].fields() == {"path": str(array), "line": 3, "record": 1}
    assert RecordOrigin("t.parquet", row=4).fields() == {"path": "t.parquet", "row": 4}
    assert str(RecordOrigin("t.parquet", row=4)) == "t.parquet row 4"


# -- issue 17: an empty chat follows the policy, a record of another kind names the kind ---------
EMPTY_CHATS = [
    ({"conversations": []}, "'conversations' is empty: no messages to train on"),
    (
        {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": " "}]},
        "'messages' holds no text",
    ),
]


@pytest.mark.parametrize(("empty", "message"), EMPTY_CHATS, ids=["no-messages", "no-text"])
def test_an_empty_chat_follows_the_bad_record_policy_in_a_store(tmp_path, empty, message):
    """It was counted as "1 empty skipped" by the reader: under fail nothing failed, under skip it
    was in neither skipped_records.jsonl nor the manifest's skipped_records."""
    from thdpack.data.write_store import write_token_store

    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(empty) + "\n")
    with pytest.raises(BadRecord, match=rf"chats.jsonl line 2: {message}.*--on-bad-record skip") as caught:
        write_token_store([str(path)], tmp_path / "fail", verbose=False)
    assert caught.value.reason == "empty_conversation"
    store = write_token_store(
        [str(path)], tmp_path / "skip", tokenize_config=TokenizeConfig(on_bad_record="skip"), verbose=False
    )
    assert len(store) == 1
    assert store.manifest["skipped_records"]["by_reason"] == {"empty_conversation": 1}
    logged = json.loads((store.path / "skipped_records.jsonl").read_text())
    assert (logged["line"], logged["reason"]) == (2, "empty_conversation")
    assert store.manifest["prepare"]["inputs"][0]["skipped_empty"] == 0


def test_a_record_of_another_kind_names_the_kind_not_the_skip_policy():
    """kind='text' over chat records said "has no field 'text' ... pass on_bad_record='skip'", a hint
    that skips every record."""
    encoder = SampleEncoder("gpt2", TokenizeConfig(kind="text"))
    with pytest.raises(BadRecord) as caught:
        encoder.encode([GOOD], ["chats.jsonl line 1"])
    assert caught.value.reason == "wrong_kind"
    assert str(caught.value) == (
        "chats.jsonl line 1: is a chat record (its keys: ['messages']), not text as kind='text' says; set "
        "kind='chat' or 'auto' (--kind; trainer: data.kind=chat, or data.kind=auto, as the data=jsonl preset has)"
    )
    alpaca = SampleEncoder("gpt2", TokenizeConfig(kind="chat"))
    with pytest.raises(BadRecord, match=r"is an alpaca record .* not chat as kind='chat' says; set kind='alpaca'"):
        alpaca.encode([{"instruction": "Say hi.", "output": "Hi!"}])
    with pytest.raises(BadRecord, match=r"has no field 'text' \(its keys: \['body'\]\); pass on_bad_record='skip'"):
        encoder.encode([{"body": "x"}])  # no other kind's fields either: the missing field, as before
