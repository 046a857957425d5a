"""Hydra-facing twins of frozen component configs.

Components keep precise, frozen configs (``Literal`` choices, checks in ``__post_init__``).
OmegaConf cannot type ``Literal`` fields and Hydra overrides need writable nodes, so each
component config gets a generated twin: same fields, defaults and order, ``Literal[...]`` typed
as ``str``, not frozen. Hydra composes the twins; ``build`` turns a twin back into the component
config, whose own checks then reject bad values with their usual messages.

>>> from dataclasses import dataclass
>>> from typing import Literal
>>> @dataclass(frozen=True, kw_only=True)
... class Example:
...     mode: Literal["a", "b"] = "a"
...     size: int = 2
>>> Node = hydra_node(Example)
>>> build(Example, Node(mode="b"))
Example(mode='b', size=2)
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal, TypeVar

C = TypeVar("C")


def _hydra_type(annotation: Any) -> Any:
    """``annotation`` with every ``Literal[...]`` replaced by ``str`` (inside Optional / unions too)."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return str
    if origin in (typing.Union, types.UnionType):
        args = tuple(_hydra_type(a) for a in typing.get_args(annotation))
        return functools.reduce(lambda a, b: a | b, args)
    return annotation


def _flat_fields(component: type, flatten: tuple[str, ...]) -> list[tuple[dataclasses.Field, Any]]:
    """(field, type hint) of ``component``, a ``flatten``-named field replaced by its dataclass's fields."""
    hints = typing.get_type_hints(component)
    out = []
    for f in dataclasses.fields(component):
        if f.name in flatten:
            out += _flat_fields(hints[f.name], ())
        else:
            out.append((f, hints[f.name]))
    return out


@functools.cache
def hydra_node(
    component: type,
    exclude: tuple[str, ...] = (),
    defaults: tuple[tuple[str, Any], ...] = (),
    extra: tuple[tuple[str, Any, Any], ...] = (),
    optional: bool = False,
    flatten: tuple[str, ...] = (),
) -> type:
    """A writable, OmegaConf-typed twin dataclass of the frozen dataclass ``component``.

    ``exclude`` leaves out fields that another config group sets (``build(..., **values)``);
    ``defaults`` gives ``(name, value)`` defaults to fields the component requires; ``extra``
    adds ``(name, type, default)`` fields of the group that the component does not have;
    ``optional`` types every field ``T | None`` (a preset may null it); ``flatten`` names fields
    holding a config dataclass whose own fields the twin lists in their place (``packing.pack_size``
    for ``PackedDatasetConfig.plan.pack_size``).
    """
    given = dict(defaults)
    fields = []
    for f, hint in _flat_fields(component, flatten):
        if not f.init or f.name in exclude:
            continue
        spec: dict[str, Any] = {}
        if f.name in given:
            spec["default"] = given[f.name]
        elif f.default is not dataclasses.MISSING:
            spec["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            spec["default_factory"] = f.default_factory
        annotation = _hydra_type(hint)
        fields.append((f.name, annotation | None if optional else annotation, dataclasses.field(**spec)))
    fields += [(name, annotation, dataclasses.field(default=default)) for name, annotation, default in extra]
    return dataclasses.make_dataclass(f"{component.__name__}Node", fields, kw_only=True)


def build(component: type[C], node: Any, *, flatten: tuple[str, ...] = (), **values: Any) -> C:
    """The component config from its Hydra twin (plus ``values`` for the excluded fields);
    ``flatten`` as given to ``hydra_node``."""
    hints = typing.get_type_hints(component)
    for f in dataclasses.fields(component):
        if f.name in flatten:
            values[f.name] = build(hints[f.name], node)
        elif f.init and f.name not in values and hasattr(node, f.name):
            values[f.name] = getattr(node, f.name)
    return component(**values)
