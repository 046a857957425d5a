"""Elastic resume (issue 25): a run continues on another number of processes, another CP size or
another global batch, with every sequence of an epoch trained exactly once.

Real launches (``torchrun``, gloo on the CPU) of the trainer on issue 17's store (300 short
records, ``short_records.py``), the tiny model on 256-token packs, fp32:

- the same packs per step on another layout (dp 2 x 1 micro-batch <-> dp 1 x 2 micro-batches,
  DDP -> FSDP2): the resumed steps train the same packs (each step's ``packs_sha256``) with the
  uninterrupted run's losses within 1e-5;
- cp 2 -> cp 1 -> dp 2 x cp 1 -> cp 2 within one epoch, each run killed with SIGKILL: from the
  checkpoints' records (one per step) every step's real tokens are new consumed tokens, and the
  epoch's consumed tokens cover the data's sequences exactly (each exactly once);
- a resize across an epoch boundary: the rest of epoch 0 planned again, epoch 1 planned as a
  fresh run with the new settings plans it.

Before: the reverse resize (1 -> 2 processes) stopped with "has no RNG state for rank 1", the other
rank with a raw gloo "Connection closed by peer"; another cp_size was refused ("state was saved by
a StepStream with other settings").
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from short_records import T, write_short_store
from test_train import REPO, losses, torchrun
from test_train_checkpoints import config
from test_train_processes import descendants

from thdpack.data.store import TokenStore
from thdpack.files.state_file import read_state
from thdpack.packing.dealing import Epochs, plan_epoch, plan_pieces
from thdpack.packing.pieces import Pieces

pytestmark = pytest.mark.distributed
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
LONG = ["train.steps=1000", "train.warmup_steps=2", "train.checkpoint_every=1", "train.keep_checkpoints=1000"]
"""A run far longer than the test: a checkpoint after every step, all kept (each is a record)."""


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return write_short_store(tmp_path_factory.mktemp("stores") / "S", seed=0)


def launch(out: Path, store: Path, *overrides: str, nproc: int = 2, check: bool = True) -> subprocess.CompletedProcess:
    return torchrun(out, out / "unused-cache", "train.micro_batches=1", f"data.store={store}", *overrides,
                    nproc=nproc, check=check)  # fmt: skip


def metrics(out: Path) -> list[dict]:
    """The complete lines of ``metrics.jsonl`` (a running trainer may be writing the last one)."""
    text = (out / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def test_another_data_parallel_layout_trains_the_same_packs_with_the_same_losses(tmp_path, store):
    """2 processes (dp 2, 1 micro-batch) -> 1 process (2 micro-batches), and 1 -> 2 processes under
    FSDP2: the packs per step stay 2, so every resumed step trains the uninterrupted run's packs."""
    run = ("parallel.cp_size=1", "train.steps=6", "train.checkpoint_every=3")
    straight = tmp_path / "straight"
    launch(straight, store, *run)
    want = metrics(straight)

    shrunk = tmp_path / "shrunk"
    launch(shrunk, store, *run, "train.stop_at=3")
    result = launch(shrunk, store, *run, "train.micro_batches=2", "train.resume=true", nproc=1)
    said = (
        "data: data-parallel size (processes / parallel.cp_size) 2 -> 1, train.micro_batches 1 -> 2: packs per step "
        "stay 2, so the run continues with the same packs in the same steps"
    )
    assert said in result.stdout, result.stdout[-3000:]

    grown = tmp_path / "grown"
    launch(grown, store, *run, "train.micro_batches=2", "train.stop_at=3", nproc=1)
    result = launch(grown, store, *run, "parallel.dp_sharding=fsdp", "train.resume=true")
    assert "data: data-parallel size (processes / parallel.cp_size) 1 -> 2, train.micro_batches 2 -> 1" in result.stdout
    for resumed in (shrunk, grown):
        got = metrics(resumed)
        assert [r["packs_sha256"] for r in got] == [r["packs_sha256"] for r in want]  # every pack matches
        assert [(r["tokens"], r["sequences"]) for r in got] == [(r["tokens"], r["sequences"]) for r in want]
        assert max(abs(a - b) for a, b in zip(losses(resumed), losses(straight), strict=True)) <= 1e-5


# -- records ------------------------------------------------------------------------------


def records(out: Path, lengths_S: np.ndarray) -> dict[int, tuple[dict, Pieces]]:
    """Every complete checkpoint's stream record: ``{step: (state, consumed pieces)}``."""
    found = {}
    for folder in (out / "checkpoints").glob("step_*"):
        if (folder / "checksums.json").is_file():
            state = read_state(folder / "stream.json")
            arrays = {key: state["arrays"][f"consumed.{key}"] for key in ("whole", "sample", "start", "length")}
            found[int(folder.name[len("step_") :])] = (state, Pieces.from_arrays(arrays, lengths_S))
    return found


def check_epoch_consumed_once(out: Path, lengths_S: np.ndarray, epoch: int = 0) -> list[dict]:
    """From the checkpoints' records (one after every step) and metrics.jsonl: each step of
    ``epoch`` consumed only new tokens, as many as it trained, and the step that ends the epoch
    consumed exactly its rest: every token of every sequence once. Returns the records by step."""
    found = records(out, lengths_S)
    steps = {r["step"]: r for r in metrics(out) if r["step"] <= max(found)}  # a killed run's last step may have none
    assert sorted(found) == sorted(steps), "a record after every step"
    everything = Pieces.whole(lengths_S)
    previous = Pieces.empty()
    for step in sorted(steps):
        state, consumed = found[step]
        if state["epoch"] == epoch:
            new = consumed.minus(previous)  # raises unless the earlier consumed pieces are still consumed
            assert new.tokens == steps[step]["tokens"], f"step {step} trained tokens it had consumed before"
            previous = consumed
        elif state["epoch"] == epoch + 1 and steps[step]["epoch"] == epoch:  # the step that ends the epoch
            rest = everything.minus(previous)
            assert rest.tokens + consumed.tokens == steps[step]["tokens"], f"step {step} did not train the rest"
            return [found[s][0] for s in sorted(found)]
    raise AssertionError(f"epoch {epoch} did not end in the records")


# -- runs killed between changes ---------------------------------------------------------------


def run_until(out: Path, store: Path, nproc: int, overrides: list[str], done, logs: Path) -> str:
    """Launch the trainer on ``nproc`` processes; once ``done(metrics)`` holds and its last step's
    checkpoint is complete, SIGKILL every process of it. Returns its stdout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "thdpack.train", *T, "train.micro_batches=1", f"data.store={store}", f"train.output_dir={out}"]
    with logs.with_suffix(".out").open("w") as stdout, logs.with_suffix(".err").open("w") as stderr:
        job = subprocess.Popen([*cmd, *LONG, *overrides], cwd=REPO, env=ENV, stdout=stdout, stderr=stderr,
                               start_new_session=True)  # fmt: skip
        try:
            end = time.monotonic() + 300
            while True:
                lines = metrics(out) if (out / "metrics.jsonl").is_file() else []
                last = lines[-1]["step"] if lines else 0
                if lines and done(lines) and (out / "checkpoints" / f"step_{last:06d}" / "checksums.json").is_file():
                    break
                assert job.poll() is None, (
                    f"the run ended (exit {job.returncode}): {logs.with_suffix('.err').read_text()[-3000:]}"
                )
                assert time.monotonic() < end, "timed out"
                time.sleep(0.05)
        finally:
            for pid in [*descendants(job.pid), job.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            job.wait()
    return logs.with_suffix(".out").read_text()


def test_three_resizes_within_an_epoch_consume_every_sequence_once(tmp_path, store):
    """cp 2 -> cp 1 (1 process) -> dp 2 x cp 1 -> cp 2, each run killed with SIGKILL after a few
    steps; the last one runs into epoch 1."""
    out = tmp_path / "out"
    lengths_S = TokenStore(store).lengths
    resumed = ["train.resume=true"]
    run_until(out, store, 2, ["parallel.cp_size=2"], lambda m: len(m) >= 5, tmp_path / "a")
    said_b = run_until(out, store, 1, ["parallel.cp_size=1", *resumed], lambda m: len(m) >= 10, tmp_path / "b")
    said_c = run_until(out, store, 2, ["parallel.cp_size=1", *resumed], lambda m: len(m) >= 15, tmp_path / "c")
    said_d = run_until(out, store, 2, ["parallel.cp_size=2", *resumed], lambda m: m[-1]["epoch"] >= 1, tmp_path / "d")
    assert "data: parallel.cp_size 2 -> 1: the remaining " in said_b
    assert " sequences of epoch 0 are planned again with parallel.cp_size=1; losses will differ" in said_b
    assert "data: packs per step 1 -> 2, data-parallel size (processes / parallel.cp_size) 1 -> 2: epoch 0's " in said_c
    assert "data: packs per step 2 -> 1, parallel.cp_size 1 -> 2, data-parallel size" in said_d

    states = check_epoch_consumed_once(out, lengths_S)
    in_epoch = [s for s in states if s["epoch"] == 0]
    assert [s["settings"]["cp_size"] for s in in_epoch][:1] == [2] and in_epoch[-1]["settings"]["cp_size"] == 2
    assert sorted({s["replans"] for s in in_epoch}) == [0, 1, 2]  # cp 2 -> 1 and 1 -> 2 planned the rest again
    assert {s["layout"]["dp_size"] for s in in_epoch} == {1, 2}
    for before, after in itertools.pairwise(in_epoch):
        if after["replans"] > before["replans"]:  # the first step of a re-plan: planned from the resumed record
            assert after["consumed_before"]["sha256"] == before["consumed"]["sha256"]
    assert states[-1]["epoch"] == 1 and states[-1]["replans"] == 0

    info = subprocess.run([sys.executable, "-m", "thdpack.cli", "checkpoint", "info", str(out)], cwd=REPO, env=ENV,
                          capture_output=True, text=True)  # fmt: skip
    assert info.returncode == 0, info.stderr
    last = states[-1]
    assert (
        f"consumed sha256: {last['consumed']['sha256']} (recomputed from the arrays: matches the record)" in info.stdout
    )
    assert f"data: {len(lengths_S):,} sequences, {int(lengths_S.sum()):,} tokens" in info.stdout
    assert "files: every file matches checksums.json" in info.stdout


def test_a_resize_across_an_epoch_boundary(tmp_path, store):
    """cp 2 (1 pack a step) stopped one pack before the end of epoch 0, resumed on 1 process at cp 1
    with 2 packs a step: the rest of epoch 0 is planned again, and epoch 1 is the plan a fresh cp 1
    run makes of it."""
    out = tmp_path / "out"
    lengths_S = TokenStore(store).lengths
    cfg = config(out, out / "unused-cache", f"data.store={store}", "parallel.cp_size=1")
    plan = cfg.packing_config.plan
    packs = len(plan_epoch(lengths_S, plan, cp_size=2, epoch=0))
    launch(out, store, *LONG, "parallel.cp_size=2", f"train.stop_at={packs - 1}")
    result = launch(out, store, *LONG, "parallel.cp_size=1", "train.micro_batches=2", "train.resume=true",
                    f"train.stop_at={packs + 2}", nproc=1)  # fmt: skip
    assert f"resumed from {out / 'checkpoints' / f'step_{packs - 1:06d}'}" in result.stdout
    assert " sequences of epoch 0 are planned again with parallel.cp_size=1" in result.stdout

    states = check_epoch_consumed_once(out, lengths_S)
    fresh = Epochs(lengths_S, plan, cp_size=1, shuffle=cfg.packing_config.shuffle)[1]
    later = [s for s in states if s["epoch"] == 1]
    assert later and all(s["replans"] == 0 and s["settings"]["cp_size"] == 1 for s in later)
    for state in later:
        arrays = {key: state["arrays"][f"consumed.{key}"] for key in ("whole", "sample", "start", "length")}
        assert Pieces.from_arrays(arrays, lengths_S) == plan_pieces(fresh.plan, fresh.order[: state["position"]])


def test_a_resume_error_on_one_rank_stops_every_rank_with_it(tmp_path, store):
    """A crafted RNG file of rank 1 only: both ranks stop with the refusal, naming rank 1 (before,
    rank 1 alone raised and rank 0 died on gloo's "Connection closed by peer")."""
    from test_train_checkpoints import RunsCode, _craft

    out = tmp_path / "out"
    run = ("parallel.cp_size=1", "train.steps=3", "train.checkpoint_every=1")
    launch(out, store, *run, "train.stop_at=2")
    folder = out / "checkpoints" / "step_000002"
    _craft(folder, "rng/rank_1.pt", RunsCode(tmp_path / "payload_ran"))
    result = launch(out, store, *run, "train.resume=true", check=False)
    assert result.returncode != 0 and not (tmp_path / "payload_ran").exists()
    refusal = f"thdpack.train: error: {folder / 'rng' / 'rank_1.pt'} is refused: it asks for the global posix.system"
    assert result.stderr.count(refusal) == 2, result.stderr[-3000:]
    assert "(on rank 1)" in result.stderr and "Connection closed" not in result.stderr
