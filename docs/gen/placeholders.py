"""``{{ key }}`` in a page's Markdown, replaced by what the key's generator writes.

Keys name a generator and its argument: ``{{ config.groups }}`` (every Hydra group),
``{{ config.component }}``, ``{{ cli.commands }}``, ``{{ perf.<name> }}`` (a table or a value
from docs/performance/), ``{{ concepts.<name> }}`` (the arrays behind a concept picture). An
unknown key is an error, so a page never shows a placeholder.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache

PLACEHOLDER = re.compile(r"\{\{ ([a-z][a-z0-9_]*(?:\.[a-z0-9_-]+)+) \}\}")


@cache
def generators() -> dict[str, Callable[[str], str]]:
    """prefix -> the function of the rest of the key."""
    from gen import config_reference, performance, pictures

    return {
        "config": lambda rest: {"groups": config_reference.hydra_groups, "components": config_reference.components}[
            rest
        ](),
        "cli": lambda rest: config_reference.commands() if rest == "commands" else config_reference.command(rest),
        "perf": performance.value,
        "concepts": pictures.text,
    }


@cache
def value(key: str) -> str:
    prefix, _, rest = key.partition(".")
    try:
        return generators()[prefix](rest)
    except KeyError as err:
        raise KeyError(f"unknown placeholder {{{{ {key} }}}} ({err})") from err


def fill(markdown: str) -> str:
    return PLACEHOLDER.sub(lambda m: value(m.group(1)), markdown)
