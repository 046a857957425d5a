"""Hydra-facing twins of frozen component configs.

Components keep precise, frozen configs (``Literal`` choices, checks in ``__post_init__``).
OmegaConf cannot type ``Literal`` fields and Hydra overrides need writable nodes, so each
component config gets a generated twin: same fields, defaults and order, ``Literal[...]`` typed
as ``str``, not frozen. Hydra composes the twins; ``build`` turns a twin back into the component
config, whose own checks then reject bad values with their usual messages.

>>> from thdpack.attention.config import AttentionConfig
>>> Node = hydra_node(AttentionConfig)
>>> Node().backend, Node.__dataclass_fields__["backend"].type   # writable, typed str for OmegaConf
('auto', <class 'str'>)
>>> build(AttentionConfig, Node(backend="math"))
AttentionConfig(backend='math', causal=True, softmax_scale=None, cp_comm_type='p2p')
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, TypeVar

from thdpack._config_forms import Part, flat_fields, from_flat, literal_as_str, twin

C = TypeVar("C")


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
    return twin(
        [Part(component, flatten)],
        name=f"{component.__name__}Node",
        module=component.__module__,
        exclude=exclude,
        defaults=dict(defaults),
        extra=[(name, annotation, dataclasses.field(default=default)) for name, annotation, default in extra],
        hint=lambda h: literal_as_str(h) | None if optional else literal_as_str(h),
    )


def build(component: type[C], node: Any, *, flatten: tuple[str, ...] = (), **values: Any) -> C:
    """The component config from its Hydra twin (plus ``values`` for the excluded fields);
    ``flatten`` as given to ``hydra_node``."""
    given = {f.name: getattr(node, f.name) for f, _ in flat_fields(component, flatten) if hasattr(node, f.name)}
    return from_flat(component, {**given, **values}, flatten)
