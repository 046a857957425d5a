"""The watchdog: name the rank the others wait for, long before the collective's timeout fails the job.

A stopped rank (``kill -STOP``, a hung driver) stalls every other rank in its next collective,
and ``torchrun`` cannot tell: the process is alive. Every rank writes a heartbeat
(``output_dir/heartbeats/rank_<r>.json``: pid, host, step) every few seconds from a thread; a
stopped process's heartbeat goes stale. When this rank's step has run longer than ``max(10 x the
median step, report_after)`` (at most half ``parallel.timeout_s``), the thread logs which ranks
have not arrived. It reads clocks and writes a small file only (no collective, no CUDA call), so
it runs while its rank waits in a collective.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SLOW_FACTOR = 10
"""A step is reported when it runs longer than this many median steps (and ``report_after``)."""
_STALE_BEATS = 3
"""A heartbeat older than this many beats (plus a second) is stale: its rank is not running."""


def heartbeat_file(folder: Path, rank: int) -> Path:
    return folder / f"rank_{rank}.json"


class Watchdog:
    """The stall reporter of one rank (a context manager; see the module docstring).

    ``folder``: where the heartbeats go (shared by all ranks); ``report_after``: the least time a
    step runs before it is reported (seconds, > 0); ``timeout_s``: the process groups' timeout,
    for the report.
    """

    def __init__(self, folder: Path, *, rank: int, world_size: int, report_after: float, timeout_s: float) -> None:
        self.folder, self.rank, self.world_size = folder, rank, world_size
        self.report_after, self.timeout_s = report_after, timeout_s
        self.beat = min(5.0, report_after / 4)
        self._durations: list[float] = []
        self._step = 0
        self._started = time.time()
        self._in_step = False
        self._reported = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._write_heartbeat()
        self._thread = threading.Thread(target=self._watch, name="thdpack-watchdog", daemon=True)
        self._thread.start()

    def step_started(self, step: int) -> None:
        """Called by the training loop (no I/O here: the thread writes the heartbeats)."""
        with self._lock:
            self._step, self._started, self._in_step = step, time.time(), True

    def step_ended(self) -> None:
        with self._lock:
            self._durations = [*self._durations[-99:], time.time() - self._started]
            self._in_step = False

    def threshold(self) -> float:
        """Seconds after which the current step is reported."""
        with self._lock:
            median = statistics.median(self._durations) if self._durations else 0.0
        return min(max(SLOW_FACTOR * median, self.report_after), self.timeout_s / 2)

    def _write_heartbeat(self) -> None:
        with self._lock:
            beat = {
                "rank": self.rank,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "step": self._step,
                "step_started": self._started,
                "in_step": self._in_step,
                "time": time.time(),
            }
        file = heartbeat_file(self.folder, self.rank)
        partial = file.with_name(f".{file.name}.partial")
        try:  # no fsync: a beat is worth nothing once the next one is due
            partial.write_text(json.dumps(beat))
            os.replace(partial, file)
        except OSError as err:
            log.warning("could not write the heartbeat %s: %s", file, err)

    def _watch(self) -> None:
        while not self._stop.wait(self.beat):
            self._write_heartbeat()
            with self._lock:
                step, elapsed, in_step = self._step, time.time() - self._started, self._in_step
            if in_step and step != self._reported and elapsed > self.threshold():
                report = self.report(step, elapsed)
                if report is not None:
                    log.warning(report)
                    self._reported = step

    def heartbeats(self) -> dict[int, dict[str, Any] | None]:
        """Every rank's last heartbeat (None: none written, or unreadable)."""
        out: dict[int, dict[str, Any] | None] = {}
        for rank in range(self.world_size):
            try:
                out[rank] = json.loads(heartbeat_file(self.folder, rank).read_text())
            except (OSError, ValueError):
                out[rank] = None
        return out

    def report(self, step: int, elapsed: float) -> str | None:
        """The report of a stalled ``step``, or None when another rank reports it."""
        now = time.time()
        stale_after = _STALE_BEATS * self.beat + 1
        beats = self.heartbeats()
        stale = {r: b for r, b in beats.items() if b is None or now - b["time"] > stale_after}
        fresh = [r for r in beats if r not in stale]
        reporter = 0 if 0 not in stale else min(fresh, default=self.rank)
        if reporter != self.rank:
            return None
        waiting = []
        for rank, beat in sorted(beats.items()):
            if rank == self.rank:  # the one waiting
                continue
            if beat is None:
                waiting.append(f"rank {rank} (no heartbeat)")
                continue
            who = f"rank {rank} (pid {beat['pid']} on {beat['host']})"
            if rank in stale:
                silent = f"no heartbeat for {now - beat['time']:.0f} s"
                waiting.append(f"{who}: {silent}, last in step {beat['step']} (stopped, or stuck outside Python)")
            elif beat["step"] < step:
                waiting.append(f"{who}: alive, still at step {beat['step']}")
        with self._lock:
            median = statistics.median(self._durations) if self._durations else None
        typical = f"the median step takes {median:.2f} s" if median is not None else "no step has finished yet"
        head = f"step {step} has run for {elapsed:.0f} s on rank {self.rank} ({typical})"
        tail = f"the job fails when a collective has waited parallel.timeout_s={self.timeout_s:g} s"
        if waiting:
            return f"{head}; waiting for {'; '.join(waiting)}; {tail}"
        return f"{head}; every rank is alive and in step {step}: the step itself is slow (a checkpoint save?); {tail}"

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            self._in_step = False
        self._write_heartbeat()  # the rank's last state: out of its last step

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
