"""``thdpack.integrations.stream_state``: the checkpoint's stream state is published as every thdpack
file is (temp file, fsync, rename), and files in the earlier layout still read."""

from __future__ import annotations

import hashlib
import json
import os

from thdpack.integrations.stream_state import STATE_FILE, read_stream_state, write_stream_state

STATE = {"steps_done": 3, "stream": {"epoch": 1, "position": 2, "packs_per_step": 4}}


def test_the_state_is_synced_to_disk_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(f"replace {os.path.basename(b)}") or real_replace(a, b))
    write_stream_state(tmp_path, STATE)
    assert events == ["fsync", f"replace {STATE_FILE}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_FILE]  # no temp file left behind
    assert read_stream_state(tmp_path) == STATE


def test_the_record_is_the_same_in_either_layout(tmp_path):
    """The digest covers the compact JSON of the state, not the file's layout: a file written with
    one-space indentation and no final newline reads, and a file written now holds the same record."""
    record = {"state": STATE, "sha256": hashlib.sha256(json.dumps(STATE, sort_keys=True).encode()).hexdigest()}
    (tmp_path / STATE_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))
    assert read_stream_state(tmp_path) == STATE
    assert json.loads(write_stream_state(tmp_path, STATE).read_text()) == record
