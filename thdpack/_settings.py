"""What every component config shares: its checks, its fingerprint, and runtime values kept apart.

A config holds settings: what a user chooses and a checkpoint must match on resume (pack size,
algorithm, seed, ...). Runtime values (the CP size, the data-parallel rank and world size, the
tokenizer's pad id) come from the run, so they are passed beside the config, to its ``build``,
never stored in it; ``refuse_settings`` turns away a runtime keyword that names a setting (the
``Config.build(**runtime)`` rule of torchtitan's ``Configurable``). Pure Python: no numpy, no torch.

>>> check_int("pack_size", 2048, 1)
2048
>>> check_int("pack_size", 20.5, 1)
Traceback (most recent call last):
...
TypeError: pack_size must be an integer, got 20.5
>>> check_int("pack_size", 0, 1)
Traceback (most recent call last):
...
ValueError: pack_size must be >= 1, got 0
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Mapping
from typing import Any


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


class Settings:
    """Base of the frozen, kw_only config dataclasses: ``fingerprint()`` and the runtime rule.

    Subclasses check their fields in ``__post_init__``; ``normalize(name, value)`` stores a checked
    value (an ``int`` for a numpy integer) in the frozen instance.
    """

    def fingerprint(self) -> dict[str, Any]:
        """The settings as plain values (saved with a resumable state, compared on resume)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def normalize(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def setting_names(self) -> set[str]:
        """This config's fields and those of the configs it holds."""
        names = set()
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            names |= {f.name, *(value.setting_names() if isinstance(value, Settings) else ())}
        return names

    def refuse_settings(self, runtime: Mapping[str, Any]) -> None:
        """``TypeError`` when a runtime keyword names one of this config's settings."""
        overlap = sorted(self.setting_names() & set(runtime))
        if overlap:
            kind = type(self).__name__
            raise TypeError(
                f"{', '.join(overlap)} {'is a setting' if len(overlap) == 1 else 'are settings'} of {kind}: "
                f"set {'it' if len(overlap) == 1 else 'them'} in the {kind}, not as a runtime value of build()"
            )


def _plain(value: Any) -> Any:
    return value.fingerprint() if isinstance(value, Settings) else value
