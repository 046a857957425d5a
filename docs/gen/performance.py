"""The performance pages' tables and numbers, from the JSON the benchmarks wrote in docs/performance/.

``value(name)`` is ``{{ perf.<name> }}``: a Markdown table or one number. Each benchmark's
command sits beside its table on the page; rerunning it with ``--json docs/performance/<file>``
refreshes the page.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

PERFORMANCE = Path(__file__).resolve().parents[1] / "performance"
VALUES: dict[str, Callable[[], str]] = {}


def value(name: str) -> str:
    if name not in VALUES:
        raise KeyError(f"docs/gen/performance.py has no value {name!r}")
    return VALUES[name]()


def produces(name: str) -> Callable[[Callable[[], str]], Callable[[], str]]:
    def register(fn: Callable[[], str]) -> Callable[[], str]:
        VALUES[name] = fn
        return fn

    return register


@cache
def load(name: str) -> Any:
    return json.loads((PERFORMANCE / name).read_text())


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(str(c) for c in r) + " |" for r in rows)]) + "\n"
