"""Test helpers shared by thdpack's own tests and by users who test their pipelines.

``run_distributed`` launches real processes (``torch.multiprocessing`` spawn, gloo on CPU)
and returns each rank's result, re-raising a rank's exception with its traceback.
``assert_resumable`` proves that a stateful iterator resumed from ``state_dict()`` at any
midpoint yields exactly what the uninterrupted run yields.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from thdpack.cp.comm import release_collectives


def _worker(
    rank: int, world_size: int, init_file: str, out_dir: str, fn: Callable, args: tuple, backend: str, threads: int
) -> None:
    torch.set_num_threads(threads)  # ranks share the machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(minutes=5)
    )
    try:
        result: Any = ("ok", fn(rank, world_size, *args))
    except BaseException as err:  # report every failure to the parent, with its traceback
        result = ("error", f"rank {rank}: {type(err).__name__}: {err}\n{traceback.format_exc()}")
    finally:
        dist.destroy_process_group()
        release_collectives()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    backend: Literal["gloo", "nccl"] = "gloo",
    threads: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return the results by rank.

    ``fn`` must be importable by name (a module-level function): ranks are spawned processes.
    ``backend="nccl"`` gives rank ``r`` the GPU ``cuda:r``; ``threads``: torch threads per rank.
    Results are pickled back to the caller. A rank that raises makes this raise
    ``RuntimeError`` with that rank's traceback, starting ``"rank R: Type: message"``.
    """
    with tempfile.TemporaryDirectory(prefix="thdpack-dist-") as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.start_processes(
            _worker,
            args=(world_size, init_file, tmp, fn, args, backend, threads),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        while not ctx.join(timeout=timeout):
            pass
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                raise RuntimeError(value)
            results.append(value)
        return results


def assert_resumable(
    make: Callable[[], Any],
    stop_after: int,
    *,
    total: int | None = None,
    equal: Callable[[Any, Any], bool] | None = None,
) -> None:
    """Check that ``make()``'s iteration resumed after ``stop_after`` items equals the full run.

    ``make`` builds a fresh stateful object that is iterable and has ``state_dict()`` /
    ``load_state_dict()``. The full run is compared item by item with: the first
    ``stop_after`` items, then a state_dict taken there, loaded into a *new* object, and the
    rest of its iteration. ``total`` caps how many items are compared (for endless streams).
    """
    eq = equal or _deep_equal

    def take(it: Iterator[Any], n: int | None) -> list[Any]:
        out = []
        for item in it:
            if n is not None and len(out) >= n:
                break
            out.append(item)
        return out

    full = take(iter(make()), total)
    first = make()
    it = iter(first)
    head = [next(it) for _ in range(stop_after)]
    state = pickle.loads(pickle.dumps(first.state_dict()))  # states must survive a checkpoint
    second = make()
    second.load_state_dict(state)
    rest = take(iter(second), None if total is None else total - stop_after)
    resumed = head + rest
    if len(resumed) != len(full):
        raise AssertionError(f"resumed run has {len(resumed)} items, uninterrupted run {len(full)}")
    for i, (a, b) in enumerate(zip(full, resumed, strict=True)):
        if not eq(a, b):
            raise AssertionError(f"item {i} differs after resuming at {stop_after}: {a!r} != {b!r}")


def _deep_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_deep_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_deep_equal(x, y) for x, y in zip(a, b, strict=True))
    try:
        import numpy as np

        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return bool(np.array_equal(a, b))
    except ImportError:
        pass
    return bool(a == b)
