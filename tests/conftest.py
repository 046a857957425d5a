"""Shared pytest setup: hypothesis profiles and the location of ../shared data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# tests run tiny tensors on a shared 2-core machine: threads cost more than they give
torch.set_num_threads(1)

settings.register_profile(
    "thdpack",
    deadline=None,  # the machine is shared and noisy: never fail on time
    max_examples=int(os.environ.get("THDPACK_HYPOTHESIS_EXAMPLES", "60")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("thdpack")

REPO = Path(__file__).resolve().parents[1]
# ../shared/data beside the checkout (CI and the main checkout); THDPACK_SHARED_DATA overrides it
SHARED_DATA = Path(os.environ.get("THDPACK_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture
def shared_data() -> Path:
    """../shared/data (real lengths, Alpaca, the GPT-2 tokenizer); skip where a clone lacks it."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is absent (only the project's own checkout has ../shared)")
    return SHARED_DATA


@pytest.fixture
def shared_data_if_any() -> Path:
    """Where ../shared/data would be, whether or not it is there (for tests that run either way)."""
    return SHARED_DATA
