"""Communication for context-parallel attention: ring neighbour exchange and row collectives.

:class:`RingComm` is what the ring talks to: ``send_recv(tensors)`` sends to the next rank and
receives from the previous one (``batch_isend_irecv``, even ranks first, so no backend deadlocks
on the pairing order). The row collectives serve the all-gather path (:func:`all_gather_rows` /
:func:`reduce_scatter_rows`) and the all-to-all path (:func:`all_to_all_blocks`, which gloo
implements as NCCL does, so the CPU path runs the GPU's collective). Each ends in :func:`finish`,
which keeps gloo's worker threads from freeing Python objects while the interpreter exits.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist


class Pending(Protocol):
    def wait(self) -> list[torch.Tensor]: ...


class Ring(Protocol):
    rank: int
    size: int

    def send_recv(self, tensors: Sequence[torch.Tensor]) -> Pending: ...


class _P2PPending:
    def __init__(self, requests: list, sent: list[torch.Tensor], received: list[torch.Tensor]) -> None:
        self._requests = requests
        self._sent = sent  # the send buffers must stay alive until the exchange completes
        self._received = received

    def wait(self) -> list[torch.Tensor]:
        for request in self._requests:
            request.wait()
        self._sent = []
        return self._received


class RingComm:
    """Ring over ``group`` (default: the world): send to ``rank + 1``, receive from ``rank - 1``."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self._next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self._prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def send_recv(self, tensors: Sequence[torch.Tensor]) -> _P2PPending:
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = []
        for out, into in zip(sent, received, strict=True):
            send = dist.P2POp(dist.isend, out, self._next, self.group)
            recv = dist.P2POp(dist.irecv, into, self._prev, self.group)
            ops += [send, recv] if self.rank % 2 == 0 else [recv, send]
        return _P2PPending(dist.batch_isend_irecv(ops), sent, received)


# torch 2.13 deprecates the *_tensor names in favour of *_single (absent before 2.13)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(size * T, ...) every rank's (T, ...) tensor, stacked in rank order."""
    x = x.contiguous()
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    finish(_all_gather(out, x, group=group, async_op=True), x)
    return out


def reduce_scatter_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(T, ...) this rank's block of the rank-stacked (size * T, ...) ``x``, summed over ranks."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    finish(_reduce_scatter(out, x, op=dist.ReduceOp.SUM, group=group, async_op=True), x)
    return out


def all_to_all_blocks(x_W: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(W, ...) block ``w`` of this rank's ``x_W`` goes to rank ``w``; returns (W, ...) whose block
    ``w`` came from rank ``w`` (``W`` = the group's size; one ``all_to_all_single``)."""
    x_W = x_W.contiguous()
    assert x_W.shape[0] == dist.get_world_size(group), "one block per rank of the group"
    out = torch.empty_like(x_W)
    finish(dist.all_to_all_single(out, x_W, group=group, async_op=True), x_W)
    return out


RECENT_WORK: collections.deque[dist.Work] = collections.deque(maxlen=8)
"""The last CPU (gloo) collectives, kept by :func:`finish`."""


def finish(work: dist.Work, x: torch.Tensor) -> None:
    """Wait for the collective ``work`` on ``x``; on the CPU keep it among :data:`RECENT_WORK`.

    gloo runs a collective on a worker thread of its own, which drops its reference to the work
    (and so to the tensors) just after ``wait()`` returns here. If it drops the last reference to a
    tensor this thread has already let go of, it takes the GIL to free the tensor's Python object;
    when that happens after the interpreter began to exit (a collective shortly before the end of a
    script), CPython ends the thread and the C++ runtime aborts the process ("terminate called
    without an active exception", SIGABRT after the results printed). Kept here, the works are
    released by this thread: the next collectives push them out, or the interpreter at exit.
    """
    work.wait()
    if x.device.type == "cpu":
        RECENT_WORK.append(work)


GIL_HANDOVER_S = 0.05
"""How long :func:`release_collectives` lets other threads hold the GIL."""


def release_collectives() -> None:
    """Before the process exits (after ``destroy_process_group``): release the works :func:`finish`
    kept, then give the GIL away for a moment, so that a gloo worker thread still freeing the
    tensors of a collective that is not thdpack's (torch's object collectives, accelerate's
    gathers) does it while the interpreter runs, not while it exits (see :func:`finish`)."""
    RECENT_WORK.clear()
    time.sleep(GIL_HANDOVER_S)
