"""The model tests run many tiny ops: one intra-op thread. With two threads on this shared 2-core
machine each tiny op waits for a busy core (measured: 0.8 s instead of 5 ms per forward/backward)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
