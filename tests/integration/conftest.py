"""Fixtures the training runs of this folder share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The runs' ``data.cache_dir``: the stdlib is tokenized once per test module."""
    return tmp_path_factory.mktemp("stores")
