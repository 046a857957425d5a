"""``launch/multi_node.sh`` as two nodes on this machine (issue 9, item 10).

Each node is the real script: ``NNODES=2 NPROC_PER_NODE=1 bash launch/multi_node.sh ...``, its
torchrun agent meets the other at a c10d rendezvous on 127.0.0.1, and the two workers train one
model with cp 2 across the nodes (the tiny ``test_train.py`` config). Both nodes write to one
``train.output_dir``, as nodes on a shared file system do: c10d hands out the global ranks itself,
so either node may be rank 0 and write ``metrics.jsonl``. The oracle is the same two ranks on one
node (``torchrun --standalone --nproc-per-node 2``), whose losses the two nodes must match exactly;
a one-process cp_size=1 run is no oracle here: cp 2 pads every document for CP divisibility, so
its packing plan, and with it every step's batch, differs.

Every process a test starts carries a tag in its environment; the test kills whatever still
carries it at the end (the agents start their workers in sessions of their own, and a killed agent
leaves its worker behind, so neither the process group nor the parent links reach them all).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_train import REPO, TINY, losses, torchrun

from thdpack.train.config import DataConfig
from thdpack.train.store_cache import open_token_store

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="finds the workers of a node through /proc (Linux)"),
]
TAG = "THDPACK_TEST_NODES"
"""Environment variable that marks every process of one test's job (agents and workers)."""
KILLED_JOB_ENDS_WITHIN_S = 60
"""How long the surviving node may take to give up after the other node's rank dies. Measured on
a shared, loaded 2-core machine: 1.2-2.9 s, whether a worker or a whole node (the rendezvous host
included) died: gloo sees the peer's socket close at the next collective, the worker raises, its
agent ends the job. Without that, the survivor would wait out the 30-minute collective timeout."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tagged(job: str) -> list[int]:
    """The processes whose environment carries ``TAG=job`` (this test's agents and workers)."""
    needle = f"{TAG}={job}".encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # gone meanwhile, or not ours
                continue
    return found


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # "pid (comm) state ppid ...": comm may hold spaces or parentheses, so split after the last ')'
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


@dataclass
class Node:
    """One ``launch/multi_node.sh`` (its torchrun agent: bash execs it) and its log."""

    proc: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def worker(self, timeout: float = 60) -> int:
        """The pid of the agent's one worker (once it has started)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = children(self.proc.pid)
            if found:
                return found[0]
            time.sleep(0.1)
        raise AssertionError(f"node {self.proc.args} started no worker in {timeout} s:\n{self.output()[-3000:]}")


@pytest.fixture
def job(tmp_path) -> Iterator[tuple[str, list[Node]]]:
    """A fresh job tag; the nodes started under it are killed (with every worker) at the end."""
    name = uuid.uuid4().hex
    nodes: list[Node] = []
    try:
        yield name, nodes
    finally:
        for _ in range(50):  # a worker may still be starting when its agent is killed: repeat
            pids = tagged(name)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        for node in nodes:
            node.proc.wait(timeout=30)
        assert not tagged(name), f"processes of job {name} survived the cleanup"


def start_nodes(job: tuple[str, list[Node]], out: Path, cache: Path, *overrides: str) -> list[Node]:
    """Start nodes 0 and 1 of a 2-node job (one process each) writing to ``out``."""
    name, nodes = job
    port = free_port()
    for node_rank in (0, 1):
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            # this interpreter's torchrun, whatever PATH holds
            "TORCHRUN": f"{sys.executable} -m torch.distributed.run",
            "NNODES": "2",
            "NODE_RANK": str(node_rank),
            "NPROC_PER_NODE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RDZV_ID": name,
            TAG: name,
        }
        log = out.parent / f"{out.name}-node{node_rank}.log"
        with log.open("w") as f:
            proc = subprocess.Popen(
                [
                    "bash",
                    str(REPO / "launch" / "multi_node.sh"),
                    *TINY,
                    f"data.cache_dir={cache}",
                    f"train.output_dir={out}",
                    *overrides,
                ],
                cwd=REPO,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        nodes.append(Node(proc, log))
    return nodes


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A token store cache holding TINY's store, built once here (not by both nodes at once)."""
    path = tmp_path_factory.mktemp("stores")
    limit = int(next(o.split("=", 1)[1] for o in TINY if o.startswith("data.limit=")))
    open_token_store(
        DataConfig(limit=limit, cache_dir=str(path)), vocab_size=50257, is_local_main=True, barrier=lambda: None
    )
    return path


RUN = ["parallel.cp_size=2", "train.steps=3", "train.checkpoint_every=0"]


def test_two_nodes_train_as_one_node_does(tmp_path, cache, job):
    # the oracle: the same 2 ranks on one node
    single = tmp_path / "single"
    torchrun(single, cache, *RUN)
    multi = tmp_path / "multi"
    nodes = start_nodes(job, multi, cache, *RUN)
    for node in nodes:
        try:
            node.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node still running after 120 s:\n{node.output()[-3000:]}") from None
    for node in nodes:
        assert node.proc.returncode == 0, f"exit {node.proc.returncode}\n{node.output()[-4000:]}"
    logs = [node.output() for node in nodes]
    # one node is rank 0 and reports; the world spans both (one process each)
    assert sum("world 2 = dp 1 x cp 2" in log for log in logs) == 1, logs
    assert losses(multi) == losses(single)
    assert len(losses(multi)) == 3
    # the final checkpoint was written and hashed by both ranks, one on each node
    rng = multi / "checkpoints" / "step_000003" / "rng"
    assert sorted(p.name for p in rng.iterdir()) == ["rank_0.pt", "rank_1.pt"]
    assert (multi / "checkpoints" / "step_000003" / "checksums.json").exists()


def wait_for_training(out: Path, nodes: list[Node], timeout: float = 120) -> None:
    """Until rank 0 has logged a step (both ranks are then in the training loop)."""
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and metrics.read_text().strip()):
        ended = [node for node in nodes if node.proc.poll() is not None]
        if ended or time.monotonic() > deadline:
            why = f"node exited {ended[0].proc.returncode}" if ended else f"no step logged in {timeout} s"
            raise AssertionError(f"{why}:\n" + "\n".join(node.output()[-3000:] for node in nodes))
        time.sleep(0.1)


@pytest.mark.parametrize(("victim", "dead"), [("worker", 1), ("node", 0)], ids=["rank-crash", "rendezvous-host-lost"])
def test_a_killed_rank_ends_the_job(tmp_path, cache, job, victim, dead):
    """SIGKILL node 1's worker (a crashed rank), or node 0's agent and worker (a lost machine;
    node 0 starts first, so its agent normally hosts the c10d store): the other node must exit
    non-zero within seconds, not wait out the 30-minute collective timeout."""
    out = tmp_path / "run"
    nodes = start_nodes(job, out, cache, "parallel.cp_size=2", "train.steps=100000", "train.checkpoint_every=0")
    wait_for_training(out, nodes)
    live = 1 - dead
    worker = nodes[dead].worker()
    killed = time.monotonic()
    if victim == "node":
        os.kill(nodes[dead].proc.pid, signal.SIGKILL)
    os.kill(worker, signal.SIGKILL)
    try:
        nodes[live].proc.wait(timeout=KILLED_JOB_ENDS_WITHIN_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"node {live} still running {KILLED_JOB_ENDS_WITHIN_S} s after node {dead}'s {victim} was killed:\n"
            f"{nodes[live].output()[-3000:]}"
        ) from None
    took = time.monotonic() - killed
    print(f"node {live} exited {nodes[live].proc.returncode} {took:.1f} s after node {dead}'s {victim} was killed")
    assert nodes[live].proc.returncode != 0, nodes[live].output()[-3000:]
    if victim == "worker":  # its agent sees the worker fail and ends the job too
        assert nodes[dead].proc.wait(timeout=KILLED_JOB_ENDS_WITHIN_S) != 0
