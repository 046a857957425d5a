"""A whole context-parallel ring in one process: ranks as threads, messages through mailboxes.

:func:`simulated_ring_attention` shards global q/k/v with TE's partition and runs the ring's
forward and backward for every rank concurrently (the same code the process-group path runs,
talking to :class:`ThreadRing`), returning the global out / LSE, differentiable. It needs no
process group, so exactness checks (gradcheck included) and single-GPU tile checks run anywhere.

Legend: ``T`` tokens (global), ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from thdpack.attention.config import resolve_softmax_scale
from thdpack.attention.merge import Gradients, OutputGrads, Saved, differentiable_attention
from thdpack.attention.ring import TileKernel, ring_backward, ring_forward
from thdpack.layout.ranks import rank_indices
from thdpack.thd.carriage import thd_meta
from thdpack.thd.meta import ThdMeta


class _MailboxPending:
    def __init__(self, mailbox: queue.Queue) -> None:
        self._mailbox = mailbox

    def wait(self) -> list[torch.Tensor]:
        return self._mailbox.get(timeout=600)


class ThreadRing:
    """The :class:`thdpack.cp.comm.RingComm` interface between threads of one process."""

    def __init__(self, rank: int, size: int, mailboxes: Sequence[queue.Queue]) -> None:
        self.rank, self.size, self._mailboxes = rank, size, mailboxes

    def send_recv(self, tensors: Sequence[torch.Tensor]) -> _MailboxPending:
        self._mailboxes[(self.rank + 1) % self.size].put([t.clone() for t in tensors])
        return _MailboxPending(self._mailboxes[self.rank])


def run_ring_threads(size: int, fn: Callable[[ThreadRing], Any]) -> list[Any]:
    """``[fn(ring of rank r) for r in range(size)]`` with the ranks running concurrently."""
    mailboxes: list[queue.Queue] = [queue.Queue() for _ in range(size)]
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            results[rank] = fn(ThreadRing(rank, size, mailboxes))
        except BaseException as err:  # re-raised in the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


@dataclass(frozen=True)
class SimulatedRing:
    """Global q, k, v -> global (out, lse) through a ring of ``len(shards)`` thread ranks (an
    :class:`~thdpack.attention.merge.LseAttention`); ``shards[r]`` is rank r's record and its
    (T / cp,) global token indices."""

    shards: list[tuple[ThdMeta, torch.Tensor]]
    causal: bool
    scale: float
    kernel: TileKernel

    def forward(self, q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor) -> tuple[torch.Tensor, ...]:
        def rank_forward(ring: ThreadRing) -> tuple[torch.Tensor, torch.Tensor]:
            meta, index = self.shards[ring.rank]
            q, k, v = q_TNH[index], k_TNH[index], v_TNH[index]
            return ring_forward(ring, q, k, v, meta, causal=self.causal, scale=self.scale, kernel=self.kernel)

        parts = run_ring_threads(len(self.shards), rank_forward)
        out_TNH = parts[0][0].new_empty((q_TNH.shape[0], *parts[0][0].shape[1:]))
        lse_NT = parts[0][1].new_empty((q_TNH.shape[1], q_TNH.shape[0]))
        for (_, index), (out, lse) in zip(self.shards, parts, strict=True):
            out_TNH[index], lse_NT[:, index] = out, lse
        return out_TNH, lse_NT

    def backward(self, saved: Saved, grads: OutputGrads) -> Gradients:
        def rank_backward(ring: ThreadRing) -> Gradients:
            meta, index = self.shards[ring.rank]
            mine = Saved(*(t[index] for t in saved[:4]), saved.lse_NT[:, index])
            dlse = None if grads.dlse_NT is None else grads.dlse_NT[:, index]
            my_grads = OutputGrads(grads.dout_TNH[index], grads.delta_NT[:, index], dlse)
            return ring_backward(ring, mine, my_grads, meta, causal=self.causal, scale=self.scale, kernel=self.kernel)

        totals = [torch.zeros_like(t) for t in saved[:3]]
        for (_, index), parts in zip(self.shards, run_ring_threads(len(self.shards), rank_backward), strict=True):
            for total, part in zip(totals, parts, strict=True):
                total[index] = part.to(total.dtype)
        return totals[0], totals[1], totals[2]


def simulated_ring_attention(
    q_TNH: torch.Tensor,
    k_TNH: torch.Tensor,
    v_TNH: torch.Tensor,
    thd: Mapping[str, Any],
    *,
    cp_size: int,
    causal: bool = True,
    softmax_scale: float | None = None,
    kernel: TileKernel = "math",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention of a whole batch as ``cp_size`` ranks would compute it, in one process.

    Args:
        q_TNH / k_TNH / v_TNH: (T, Nq, H) / (T, Nkv, H) / (T, Nkv, Hv), the GLOBAL batch in storage
            order; T a multiple of ``2*cp_size`` per sequence (``cu_seqlens_padded``).
        thd: the global batch (or any of its shards: the metadata is global).
        cp_size, causal, softmax_scale, kernel: as for :func:`thdpack.attention.ring.ring_attention`.

    Returns:
        ``out_TNH`` (T, Nq, Hv) in q's dtype and ``lse_NT`` (Nq, T), in storage order, both
        differentiable (the backward runs the ring's backward on all ranks).

    >>> cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    >>> thd = {"cu_seqlens": cu, "cu_seqlens_padded": torch.tensor([0, 4, 8], dtype=torch.int32)}
    >>> x = torch.randn(8, 2, 4, dtype=torch.float64)
    >>> out, lse = simulated_ring_attention(x, x, x, thd, cp_size=2)
    >>> single, _ = simulated_ring_attention(x, x, x, thd, cp_size=1)
    >>> bool(torch.allclose(out[[0, 1, 2, 4, 5, 6, 7]], single[[0, 1, 2, 4, 5, 6, 7]]))  # real tokens
    True
    """
    whole = thd_meta(thd).unsharded()
    whole.check_token_count(q_TNH.shape[0], "q (the global batch's, as simulated_ring_attention takes)")
    if whole.groups is not None:
        raise ValueError(
            "simulated_ring_attention runs one ring over Transformer Engine's layout, but this batch has a "
            "per-sequence CP placement (whole sequences and groups of ranks); run thd_attention on its shards "
            "over a process group (thdpack.testing.run_distributed on gloo)"
        )
    shards = []
    for rank in range(cp_size):
        index = rank_indices(whole.lengths_padded_S, cp_size, rank)
        shards.append((whole.for_rank(cp_size, rank), torch.from_numpy(index).to(q_TNH.device, torch.int64)))
    scale = resolve_softmax_scale(softmax_scale, q_TNH.shape[-1])
    return differentiable_attention(q_TNH, k_TNH, v_TNH, SimulatedRing(shards, causal, scale, kernel))
