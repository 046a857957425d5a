"""A progress bar that is tqdm on a terminal and silent elsewhere (logs, CI, DataLoader workers)."""

from __future__ import annotations

import sys
from typing import Any

from thdpack._optional import has_module


class _Silent:
    """Takes ``update`` / ``close`` calls and prints nothing."""

    def update(self, n: int = 1) -> None:
        del n

    def set_postfix_str(self, text: str) -> None:
        del text

    def close(self) -> None:
        return None


def progress_bar(*, total: int | None, desc: str, unit: str, enabled: bool | None = None) -> Any:
    """tqdm when installed and ``enabled`` (None: when stderr is a terminal); else a silent bar."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not (enabled and has_module("tqdm")):
        return _Silent()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True)
