"""`thdpack prepare` end to end on tiny corpora, and its errors as messages with a non-zero exit."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from thdpack._optional import has_module
from thdpack.data import verify_store
from thdpack.data.manifest import StoreError
from thdpack.data.prepare_command import add_prepare_arguments, run_prepare
from thdpack.data.store import TokenStore
from thdpack.data.tokenizer import load_tokenizer
from thdpack.files.lock import FolderLock
from thdpack.files.publish import file_digest
from thdpack.packing.dealing import plan_epoch
from thdpack.plan import PackPlan, PlanConfig
from thdpack.plan.config import TRAINING_CP_PLACEMENT

REPO = Path(__file__).resolve().parents[3]


def prepare(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="thdpack prepare")
    add_prepare_arguments(parser)
    return run_prepare(parser.parse_args([*argv, "--no-progress"]))


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    docs = [{"text": " ".join(["word"] * n)} for n in (3, 40, 7, 25, 60, 1, 12)] + [{"text": ""}]
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def test_end_to_end(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert prepare(str(corpus), "--pack-size", "64", "--cp-size", "2", "--out", str(out)) == 0
    printed = capsys.readouterr().out
    assert "7 records, 1 empty skipped" in printed
    assert "efficiency" in printed and "lower bound (L2)" in printed  # the PackingStats table
    store = TokenStore(out)
    # "word word ..." (n words) is n GPT-2 tokens; EOS is appended and labels are shifted: n input tokens
    assert store.lengths.tolist() == [3, 40, 7, 25, 60, 1, 12]
    assert store[5]["input_ids"].tolist() == [4775] and store[5]["labels"].tolist() == [50256]
    plan = PackPlan.load(out / "plan.npz")
    assert sorted(np.concatenate(list(plan)).tolist()) == list(range(7))  # every sample exactly once
    assert plan.pack_size == 64 and plan.cp_size == 2
    # epoch 0's plan exactly as a trainer with these settings makes it (seed derived from (0, 0))
    config = PlanConfig(pack_size=64, seed=0, cp_placement=TRAINING_CP_PLACEMENT)  # prepare defaults as the trainer
    trainers = plan_epoch(store.lengths, config, cp_size=2, epoch=0)
    assert plan.seed == trainers.seed and [p.tolist() for p in plan] == [p.tolist() for p in trainers]
    manifest = json.loads((out / "manifest.json").read_text())
    record = manifest["plan"]
    assert record["config"] == config.fingerprint() and record["cp_size"] == 2 and record["file"] == "plan.npz"
    assert record["checksum"] == file_digest(out / "plan.npz") and record["stats"]["num_sequences"] == 7
    assert manifest["prepare"]["inputs"][0]["skipped_empty"] == 1
    assert manifest["prepare"]["tokenize_report"]["samples"] == 7
    if has_module("matplotlib"):
        assert (out / "lengths.png").stat().st_size > 0 and (out / "fullness.png").stat().st_size > 0
    else:
        assert "no plots: matplotlib is not installed" in printed


def test_sft_json_with_limit_and_options(tmp_path, capsys):
    records = [{"instruction": f"Repeat {i}.", "input": "", "output": f"{i}"} for i in range(5)]
    (tmp_path / "sft.json").write_text(json.dumps(records))
    out = tmp_path / "out"
    args = [str(tmp_path / "sft.json"), "--pack-size", "128", "--out", str(out), "--limit", "3"]
    assert prepare(*args, "--algorithm", "sequential", "--no-plots", "--sample-format", "loss_mask") == 0
    assert "stopped after the first 3 records (--limit)" in capsys.readouterr().out
    store = TokenStore(out)
    assert len(store) == 3 and (out / "loss_mask.bin").exists() and not (out / "lengths.png").exists()
    assert store.sample_format == "loss_mask" and store[0]["loss_mask"].sum() == 2  # "0" and EOS
    assert [p.tolist() for p in PackPlan.load(out / "plan.npz")] == [[0, 1, 2]]


def test_errors_are_messages(corpus, tmp_path, capsys):
    out = str(tmp_path / "out")

    def error(*argv: str) -> str:
        assert prepare(*argv) == 2
        return capsys.readouterr().err

    assert "input 'nope.jsonl' does not exist" in error("nope.jsonl", "--pack-size", "64", "--out", out)
    (tmp_path / "d.csv").write_text("a,b\n")
    assert "cannot tell the format of" in error(str(tmp_path / "d.csv"), "--pack-size", "64", "--out", out)
    assert "tokenizer 'gpt3' is neither a shipped one" in error(
        str(corpus), "--tokenizer", "gpt3", "--pack-size", "64", "--out", out
    )
    assert "pack_size=63 is not a multiple of 2*cp_size=4" in error(
        str(corpus), "--pack-size", "63", "--cp-size", "2", "--out", out
    )
    assert not (tmp_path / "out").exists()  # both were caught before anything was written
    message = error(str(corpus), "--pack-size", "32", "--out", out)
    assert "has 40 tokens" in message and "only planning failed" in message
    assert "already holds token store files" in error(str(corpus), "--pack-size", "64", "--out", out)
    assert prepare(str(corpus), "--pack-size", "64", "--out", out, "--overwrite", "--no-plots") == 0
    capsys.readouterr()
    assert "only planning failed" in error(str(corpus), "--pack-size", "32", "--out", out, "--overwrite")
    assert not (tmp_path / "out" / "plan.npz").exists()  # the older plan went with the older store
    assert "line 1: is a text record (its keys: ['text']), not chat as kind='chat' says; set kind='text'" in error(
        str(corpus), "--kind", "chat", "--pack-size", "64", "--out", out + "2"
    )
    (tmp_path / "short.jsonl").write_text('{"text": "word"}\n')  # one token, nothing to predict
    assert "no samples to store: 1 records (text: 1) -> 0 samples" in error(
        str(tmp_path / "short.jsonl"), "--no-eos", "--pack-size", "64", "--out", out + "3"
    )
    with pytest.raises(SystemExit):
        prepare(str(corpus), "--format", "csv", "--pack-size", "64", "--out", out)
    assert "invalid choice: 'csv'" in capsys.readouterr().err


def test_out_naming_a_file_is_a_message(corpus, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert prepare(str(corpus), "--pack-size", "64", "--out", str(tmp_path / "notes.txt")) == 2
    err = capsys.readouterr().err  # "[Errno 17] File exists" before
    assert f"thdpack prepare: error: {tmp_path / 'notes.txt'} is an existing file, not a folder" in err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_folder_being_written_is_refused_and_left_alone(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert prepare(str(corpus), "--pack-size", "64", "--out", str(out), "--no-plots") == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with FolderLock(out):  # as another `thdpack prepare --overwrite` would hold it
        assert prepare(str(corpus), "--pack-size", "128", "--out", str(out), "--overwrite") == 2
    assert f"{out} is being written by another process (pid {os.getpid()} on " in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert verify_store(out).num_samples == 7


def test_the_manifest_keeps_its_checksums_after_the_plan_is_added(corpus, tmp_path):
    assert prepare(str(corpus), "--pack-size", "64", "--out", str(tmp_path / "out"), "--no-plots") == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert set(manifest["checksums"]) == {"tokens.bin", "offsets.npy"} and "plan" in manifest
    assert verify_store(tmp_path / "out").checksums
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "out"]  # the lock file went too


def test_a_damaged_plan_is_an_error_naming_it(corpus, tmp_path):
    out = tmp_path / "out"
    assert prepare(str(corpus), "--pack-size", "64", "--algorithm", "window", "--window", "4", "--out", str(out)) == 0
    assert json.loads((out / "manifest.json").read_text())["plan"]["config"]["window"] == 4
    data = bytearray((out / "plan.npz").read_bytes())
    data[len(data) // 2] ^= 1
    (out / "plan.npz").write_bytes(bytes(data))
    with pytest.raises(StoreError, match=rf"{out / 'plan.npz'} does not match its sha256 in manifest.json"):
        verify_store(out)


@pytest.mark.distributed
def test_concurrent_overwrites_leave_one_runs_complete_store(tmp_path):
    """Two real `thdpack prepare --overwrite` processes into one folder (a mix of one run's
    manifest and the other's tokens before): the second stops, or waits its turn by luck."""
    texts = {"a": [("alpha " * (5 + i % 40)).strip() for i in range(6000)]}
    texts["b"] = [("beta gamma " * (3 + i % 30)).strip() for i in range(5000)]
    for name, docs in texts.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "thdpack.cli", "prepare", "--pack-size", "512", "--out", str(out)]
    runs = {
        name: subprocess.Popen(
            [*command, str(tmp_path / f"{name}.jsonl"), "--overwrite", "--no-plots", "--no-progress"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in texts
    }
    results = {name: (run.wait(timeout=300), run.stderr.read()) for name, run in runs.items()}  # type: ignore[union-attr]
    for code, err in results.values():
        assert code == 0 or (code == 2 and f"{out} is being written by another process (pid" in err), err
    assert 0 in [code for code, _ in results.values()]
    result = verify_store(out)  # the manifest's checksums match the files
    winner = Path(json.loads((out / "manifest.json").read_text())["source"][0]["path"]).stem
    assert results[winner][0] == 0
    store = TokenStore(out)
    docs = texts[winner]
    assert result.num_samples == len(store) == len(docs)
    gpt2 = load_tokenizer("gpt2")
    for i in (0, len(docs) // 2, len(docs) - 1):  # the tokens are the winner's
        assert store.tokenized(i).tokens.tolist() == [*gpt2.encode_batch([docs[i]])[0], gpt2.eos_id]
    assert sorted(np.concatenate(list(PackPlan.load(out / "plan.npz"))).tolist()) == list(range(len(docs)))


@pytest.fixture
def sharegpt(tmp_path):
    """ShareGPT as it is found: an empty conversation, one without a reply, an unknown speaker."""
    path = tmp_path / "sharegpt.jsonl"
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]},
        {"id": "b", "conversations": []},
        {"id": "c", "conversations": [{"from": "human", "value": "only a question"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "q"}, {"from": "bing", "value": "x"}]},
        {"id": "e", "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_bad_records_fail_naming_the_line_by_default(sharegpt, tmp_path, capsys):
    # the old code named only line 4 (the unknown role); without it, line 2's empty conversation
    # crashed with "need at least one array to concatenate"
    assert prepare(str(sharegpt), "--pack-size", "64", "--out", str(tmp_path / "out"), "--no-plots") == 2
    err = capsys.readouterr().err
    assert f"error: {sharegpt} line 2: 'conversations' is empty: no messages to train on; " in err
    assert "--on-bad-record skip" in err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_bad_records_skipped_are_counted_printed_and_listed(sharegpt, tmp_path, capsys):
    out = tmp_path / "out"
    args = [str(sharegpt), "--pack-size", "64", "--out", str(out), "--no-plots"]
    assert prepare(*args, "--on-bad-record", "skip") == 0
    printed = capsys.readouterr().out
    assert (
        "skipped 3 bad records (empty_conversation 1, no_assistant_turn 1, unknown_role 1); "
        f"listed in {out / 'skipped_records.jsonl'}"
    ) in printed
    assert "0 without targets, 3 bad" in printed and "skipped_records.jsonl, plan.npz" in printed
    assert len(TokenStore(out)) == 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["skipped_records"] == {
        "policy": "skip",
        "total": 3,
        "by_reason": {"empty_conversation": 1, "no_assistant_turn": 1, "unknown_role": 1},
        "file": "skipped_records.jsonl",
    }
    assert manifest["prepare"]["tokenize"]["on_bad_record"] == "skip"
    assert manifest["prepare"]["tokenize_report"]["skipped_bad"] == 3
    logged = [json.loads(line) for line in (out / "skipped_records.jsonl").read_text().splitlines()]
    assert [(e["path"], e["line"], e["reason"]) for e in logged] == [
        (str(sharegpt), 2, "empty_conversation"),
        (str(sharegpt), 3, "no_assistant_turn"),
        (str(sharegpt), 4, "unknown_role"),
    ]
    assert logged[1]["message"] == "has no 'gpt' message to train on (its roles: ['human'])"
    # a new store never keeps an older skip list
    good = tmp_path / "good.jsonl"
    good.write_text(sharegpt.read_text().splitlines()[0] + "\n")
    assert prepare(str(good), "--pack-size", "64", "--out", str(out), "--no-plots", "--overwrite") == 0
    assert not (out / "skipped_records.jsonl").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["skipped_records"] == {"policy": "fail", "total": 0, "by_reason": {}, "file": None}


def test_all_records_bad_is_an_error_with_the_counts(tmp_path, capsys):
    # the old code crashed here with "need at least one array to concatenate"
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 1, "messages": []}\n{"id": 2, "messages": []}\n')
    out = str(tmp_path / "out")
    assert prepare(str(path), "--pack-size", "64", "--out", out, "--on-bad-record", "skip") == 2
    err = capsys.readouterr().err
    assert "no samples to store: 2 records (chat: 2) -> 0 samples" in err
    assert "skipped 2 bad records (empty_conversation 2)" in err
