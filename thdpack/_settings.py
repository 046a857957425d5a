"""What every component config shares: its fields' help and checks, its fingerprint.

A config holds settings, what a user chooses and a checkpoint must match on resume. Each field is
declared once with ``setting(help, default=..., check=...)``: the help and the check are data on
the field, so the config checks itself field by field and its other forms (``thdpack._config_forms``)
show the same help and run the same checks. Runtime values (the CP size, the DP rank and size, the
pad id) travel beside a config, never in it (``thdpack.packing.PackingRuntime``). Pure Python.

>>> check_int("pack_size", 2048, 1)
2048
>>> check_int("pack_size", 20.5, 1)
Traceback (most recent call last):
...
TypeError: pack_size must be an integer, got 20.5
>>> optional(integer(0))("seed", -1)
Traceback (most recent call last):
...
ValueError: seed must be >= 0, got -1
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

Check = Callable[[str, Any], Any]
"""A field's check: ``check(name, value)`` returns the value to store (an ``int`` for a numpy
integer) or raises ``TypeError`` / ``ValueError`` naming the field."""


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an ``int``: ``TypeError`` unless it is an integer (numpy's included, bools not),
    ``ValueError`` when it is below ``minimum``. Every integer setting and runtime value is checked here."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_choice(name: str, value: object, options: Iterable[str]) -> None:
    """``ValueError`` listing the valid options unless ``value`` is one of them."""
    options = tuple(options)
    if value not in options:
        raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(options)}")


def integer(minimum: int) -> Check:
    """The check of an integer field: ``check_int`` with ``minimum``."""
    return lambda name, value: check_int(name, value, minimum)


def one_of(options: Iterable[str], label: str | None = None) -> Check:
    """The check of a closed set: ``check_choice`` (the message says ``label``, default the field's name)."""
    options = tuple(options)

    def check(name: str, value: Any) -> Any:
        check_choice(label or name, value, options)
        return value

    return check


def flag(name: str, value: Any) -> bool:
    """The check of a ``bool`` field: ``TypeError`` for anything but True / False (1 included)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def text(name: str, value: Any) -> str:
    """The check of a text field: ``TypeError`` for anything but a non-empty ``str``."""
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be a non-empty string, got {value!r}")
    return value


def optional(check: Check) -> Check:
    """``check``, letting None through."""
    return lambda name, value: None if value is None else check(name, value)


def setting(help: str, *, default: Any = dataclasses.MISSING, check: Check | None = None, **field: Any) -> Any:
    """A config field with its help text and its check, the one place both are declared
    (``dataclasses.field(metadata={"help": ..., "check": ...})``, as transformers'
    ``HfArgumentParser`` reads ``metadata["help"]``); ``field`` passes e.g. ``default_factory``."""
    return dataclasses.field(default=default, metadata={"help": help, "check": check}, **field)


def field_help(f: dataclasses.Field) -> str:
    return f.metadata.get("help", "")


def field_checks(config: Any) -> dict[str, Check]:
    """The checks of ``config``'s fields (``setting(check=...)``), by field name."""
    return {f.name: f.metadata["check"] for f in dataclasses.fields(config) if f.metadata.get("check")}


def check_fields(config: Any, checks: Mapping[str, Check] | None = None) -> None:
    """Run the checks (default: ``field_checks(config)``) on the frozen dataclass ``config``,
    storing each checked value."""
    for name, check in (field_checks(config) if checks is None else checks).items():
        object.__setattr__(config, name, check(name, getattr(config, name)))


class Settings:
    """Base of the frozen, kw_only config dataclasses: their fields' checks and ``fingerprint()``.

    ``__post_init__`` runs each field's check; a subclass with checks that span fields calls it first.
    """

    def __post_init__(self) -> None:
        check_fields(self)

    def fingerprint(self) -> dict[str, Any]:
        """The settings as plain values (saved with a resumable state, compared on resume)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]


def _plain(value: Any) -> Any:
    return value.fingerprint() if isinstance(value, Settings) else value
