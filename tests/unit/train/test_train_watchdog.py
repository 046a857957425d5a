"""The watchdog's report: who the ranks wait for, and who reports (issue 17, item 8). The heartbeat
files are written here by hand; ``tests/integration/test_train_processes.py`` stops a real rank."""

from __future__ import annotations

import json
import time
from pathlib import Path

from thdpack.train.watchdog import Watchdog, heartbeat_file


def beat(folder: Path, rank: int, *, step: int, age: float) -> None:
    record = {"rank": rank, "pid": 100 + rank, "host": "node", "step": step, "time": time.time() - age}
    heartbeat_file(folder, rank).write_text(json.dumps(record))


def watchdog(folder: Path, rank: int) -> Watchdog:
    return Watchdog(folder, rank=rank, world_size=3, report_after=60.0, timeout_s=600.0)  # beats every 5 s


def test_the_report_names_the_silent_and_the_late_ranks(tmp_path):
    with watchdog(tmp_path, 0) as dog:
        beat(tmp_path, 1, step=7, age=40)
        beat(tmp_path, 2, step=6, age=1)
        report = dog.report(7, 61.0)
    assert report == (
        "step 7 has run for 61 s on rank 0 (no step has finished yet); waiting for rank 1 (pid 101 on node): no "
        "heartbeat for 40 s, last in step 7 (stopped, or stuck outside Python); rank 2 (pid 102 on node): alive, "
        "still at step 6; the job fails when a collective has waited parallel.timeout_s=600 s"
    )


def test_the_lowest_live_rank_reports_when_rank_0_is_silent(tmp_path):
    beat(tmp_path, 0, step=3, age=40)
    with watchdog(tmp_path, 1) as one, watchdog(tmp_path, 2) as two:
        assert "waiting for rank 0 (pid 100 on node): no heartbeat for 40 s" in one.report(3, 70.0)
        assert two.report(3, 70.0) is None


def test_a_slow_step_with_every_rank_alive_says_so(tmp_path):
    with watchdog(tmp_path, 0) as dog:
        beat(tmp_path, 1, step=4, age=0)
        beat(tmp_path, 2, step=4, age=0)
        assert "every rank is alive and in step 4: the step itself is slow" in dog.report(4, 90.0)
    assert json.loads(heartbeat_file(tmp_path, 0).read_text())["in_step"] is False


def test_the_threshold_is_ten_median_steps_and_at_most_half_the_timeout(tmp_path):
    with watchdog(tmp_path, 0) as dog:
        assert dog.threshold() == 60.0
        dog._durations = [20.0, 21.0, 22.0]
        assert dog.threshold() == 210.0
        dog._durations = [100.0]
        assert dog.threshold() == 300.0
