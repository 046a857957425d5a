"""The step prefetch thread: same steps in the same order, the right stream state with each,
errors raised in the training loop, and a clean stop."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from thdpack.packing import PackedDataset
from thdpack.thd import thd_collate
from thdpack.thd.batch import thd_pin_memory
from thdpack.train.prefetch import StepPrefetcher

LENGTHS = (3, 5, 2, 6, 4, 7, 1, 8, 5, 3, 6, 2)


def _stream():
    samples = [{"input_ids": list(range(1, n + 1))} for n in LENGTHS]
    return PackedDataset(samples, 8, seed=0).step_stream(micro_batches=2, packs_per_micro_batch=1)


def _collate(step):
    return [thd_collate(packs) for packs in step.micro_batches]


def _summary(prepared):
    ids = [mb["input_ids"].tolist() for mb in prepared.micro_batches]
    return prepared.step.epoch, ids, prepared.stream_state.epoch, prepared.stream_state.position


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_prefetched_steps_equal_the_steps_made_in_the_loop(depth):
    with StepPrefetcher(_stream(), _collate, depth=0) as steps:
        want = [_summary(steps.next()) for _ in range(9)]  # crosses epoch boundaries
    with StepPrefetcher(_stream(), _collate, depth=depth) as steps:
        got = [_summary(steps.next()) for _ in range(9)]
    assert got == want
    assert {epoch for epoch, *_ in want} == {0, 1, 2}


def test_each_step_carries_the_stream_state_right_after_it():
    """A checkpoint after step k saves that state; a stream loaded from it continues with step k+1,
    although the thread has already advanced the stream further."""
    with StepPrefetcher(_stream(), _collate, depth=3) as steps:
        prepared = [steps.next() for _ in range(4)]
        time.sleep(0.2)  # the thread runs ahead
    resumed = _stream()
    resumed.load_state_dict(prepared[1].stream_state.state_dict())
    with StepPrefetcher(resumed, _collate, depth=0) as steps:
        assert [_summary(steps.next()) for _ in range(2)] == [_summary(p) for p in prepared[2:]]


def test_an_error_while_preparing_is_raised_by_next_after_the_good_steps():
    made = []

    def prepare(step):
        made.append(step)
        if len(made) == 3:
            raise ValueError("sample 17 has length -4")
        return _collate(step)

    with StepPrefetcher(_stream(), prepare, depth=2) as steps:
        steps.next(), steps.next()
        with pytest.raises(ValueError, match="sample 17 has length -4"):
            steps.next()


def test_close_stops_a_thread_blocked_on_a_full_queue():
    before = threading.active_count()
    steps = StepPrefetcher(_stream(), _collate, depth=1)
    time.sleep(0.2)  # the queue is full, the producer waits
    tick = time.perf_counter()
    steps.close()
    assert time.perf_counter() - tick < 5
    assert threading.active_count() == before
    with pytest.raises(RuntimeError, match="after close"):
        steps.next()


def test_the_wait_for_a_slow_step_is_measured():
    def slow(step):
        time.sleep(0.05)
        return _collate(step)

    with StepPrefetcher(_stream(), slow, depth=0) as steps:
        steps.next()
        assert steps.wait_seconds >= 0.05


@pytest.mark.parametrize(
    ("depth", "error", "message"),
    [(-1, ValueError, "prefetch depth must be >= 0, got -1"), (1.5, TypeError, "prefetch depth must be an integer")],
)
def test_a_bad_depth_is_refused(depth, error, message):
    with pytest.raises(error, match=message):
        StepPrefetcher(_stream(), _collate, depth=depth)
    with pytest.raises(TypeError, match="prefetch depth must be an integer, got True"):
        StepPrefetcher(_stream(), _collate, depth=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pinned_batches_keep_their_record_and_copy_without_blocking():
    from thdpack.thd import thd_to_device
    from thdpack.thd.carriage import thd_meta

    with StepPrefetcher(_stream(), _collate, depth=0) as steps:
        host = steps.next().micro_batches[0]
    pinned = thd_pin_memory(host)
    assert all(t.is_pinned() for t in pinned.values() if isinstance(t, torch.Tensor))
    assert thd_meta(pinned) == thd_meta(host)
    moved = thd_to_device(pinned, "cuda", non_blocking=True)
    assert torch.equal(moved["input_ids"].cpu(), host["input_ids"])
