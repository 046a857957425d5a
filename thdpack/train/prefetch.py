"""The next steps' batches, made on the host while the device trains on this one.

Planning, building, collating and CP-sharding a step is host work; between two steps it would
leave the GPU idle. :class:`StepPrefetcher` does it in a background thread ``depth`` steps ahead
(the numpy / torch kernels release the GIL) and pins the batches on CUDA, so the trainer's
``non_blocking`` copies overlap with compute. One producer keeps the stream's order, and each
prepared step carries the stream's state right after it: what a checkpoint after that step must
save, since the thread has moved the stream further. ``depth=0`` works in the calling thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from thdpack._settings import check_int
from thdpack.packing.step_stream import Step, StepStream, StreamState
from thdpack.thd.format import THDBatch

_POLL_SECONDS = 0.1


@dataclass(frozen=True)
class PreparedStep:
    """One step, ready for the device."""

    step: Step
    micro_batches: list[THDBatch]
    """This rank's micro-batches as ``prepare`` returned them (host; pinned on CUDA)."""
    stream_state: StreamState
    """``stream.state()`` right after this step: what a checkpoint after it saves."""


@dataclass(frozen=True)
class _Failure:
    error: BaseException


class StepPrefetcher:
    """Prepared steps of ``stream``, in order, made ``depth`` steps ahead in a background thread.

    >>> from thdpack.packing import PackedDataset
    >>> samples = [{"input_ids": list(range(1, n + 1))} for n in (3, 5, 2, 6, 4, 7)]
    >>> stream = PackedDataset(samples, 8, seed=0).step_stream(micro_batches=1, packs_per_micro_batch=1)
    >>> with StepPrefetcher(stream, lambda step: [], depth=2) as steps:
    ...     [steps.next().stream_state.position for _ in range(3)]
    [1, 2, 3]
    """

    def __init__(
        self,
        stream: StepStream,
        prepare: Callable[[Step], list[THDBatch]],
        *,
        depth: int = 2,
        before_read: Callable[[], None] | None = None,
    ) -> None:
        check_int("prefetch depth", depth, 0)
        self.stream, self.prepare, self.depth = stream, prepare, depth
        self.before_read = before_read
        """Called before each step's packs are read, in the thread that reads them; what it raises
        is raised by :meth:`next` (the trainer checks that the store's files are unchanged:
        ``TokenStore.check_unchanged``)."""
        self.wait_seconds = 0.0
        """How long the last :meth:`next` waited for its step (the host stalled the step by this)."""
        self._queue: queue.Queue[PreparedStep | _Failure] = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._thread = threading.Thread(target=self._produce, name="thdpack-step-prefetch", daemon=True)
            self._thread.start()

    def _make(self) -> PreparedStep:
        if self.before_read is not None:
            self.before_read()
        step = self.stream.next_step()
        return PreparedStep(step=step, micro_batches=self.prepare(step), stream_state=self.stream.state())

    def _produce(self) -> None:
        while not self._stop.is_set():
            try:
                item: PreparedStep | _Failure = self._make()
            except BaseException as error:  # handed to the consumer, which raises it
                item = _Failure(error)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=_POLL_SECONDS)
                    break
                except queue.Full:
                    continue
            if isinstance(item, _Failure):
                return

    def next(self) -> PreparedStep:
        """The next step; raises what preparing it raised (the original exception)."""
        tick = time.perf_counter()
        if self._thread is None:
            item: PreparedStep | _Failure = self._make()
        else:
            if self._stop.is_set():
                raise RuntimeError("StepPrefetcher.next() after close()")
            while True:
                try:
                    item = self._queue.get(timeout=_POLL_SECONDS)
                    break
                except queue.Empty:
                    if not self._thread.is_alive() and self._queue.empty():
                        raise RuntimeError("the step prefetch thread ended without a step or an error") from None
        self.wait_seconds = time.perf_counter() - tick
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def close(self) -> None:
        """Stop the thread (it finishes the step it is making, which is discarded)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()  # a producer waiting on a full queue sees the stop within _POLL_SECONDS

    def __enter__(self) -> StepPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
