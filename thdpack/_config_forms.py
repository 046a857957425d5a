"""The other forms of a component config, generated from its fields.

A setting is declared once, as a field of its frozen config with its help and its check; every
other form a user meets is generated from the fields, so a new setting appears in each by itself:
flat keywords (:class:`FlatKeywords`: ``PackedDataset(samples, 2048, cp_placement="adaptive")``),
a dataclass twin with other defaults (:func:`twin`: the Hydra ``packing`` node,
``PackingArguments``) and command-line options (:func:`add_options`). A field holding a config
(``PackedDatasetConfig.plan``) is flattened: its fields take its place. Pure Python.

>>> from thdpack.packing import PackedDatasetConfig
>>> [f.name for f, _ in flat_fields(PackedDatasetConfig, ("plan",))]  # doctest: +NORMALIZE_WHITESPACE
['pack_size', 'algorithm', 'overflow', 'window', 'seed', 'cp_placement', 'cost_model', 'profile',
 'model_shape', 'improve', 'shuffle', 'remainder', 'balance']
>>> config = from_flat(PackedDatasetConfig, {"pack_size": 64, "shuffle": False}, ("plan",))
>>> config.plan.pack_size, config.shuffle, flat_values(config, ("plan",))["algorithm"]
(64, False, 'bfd')
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import operator
import textwrap
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Literal, TypeVar

from thdpack._settings import field_help, optional, setting

C = TypeVar("C")
F = TypeVar("F", bound=Callable[..., Any])


def flat_fields(config: type, flatten: Collection[str] = ()) -> list[tuple[dataclasses.Field, Any]]:
    """(field, type hint) of ``config``'s init fields, a field named in ``flatten`` replaced by the
    fields of the config dataclass it holds."""
    hints = typing.get_type_hints(config)
    out = []
    for f in dataclasses.fields(config):
        if not f.init:
            continue
        out += flat_fields(hints[f.name]) if f.name in flatten else [(f, hints[f.name])]
    return out


def from_flat(config: type[C], values: Mapping[str, Any], flatten: Collection[str] = ()) -> C:
    """``config`` made from flat ``values`` (by ``flat_fields``' names; other names are not its and
    are passed over); a field missing from ``values`` takes its default, and ``config`` checks the rest."""
    hints = typing.get_type_hints(config)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(config):  # type: ignore[arg-type]
        if f.init and f.name in flatten:
            kwargs[f.name] = from_flat(hints[f.name], values)
        elif f.init and f.name in values:
            kwargs[f.name] = values[f.name]
    return config(**kwargs)


def flat_values(config: Any, flatten: Collection[str] = ()) -> dict[str, Any]:
    """``config``'s values by ``flat_fields``' names: what ``from_flat`` makes it from."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        values.update(flat_values(value) if f.name in flatten else {f.name: value})
    return values


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


# -- flat keywords ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Part:
    """One config a flat door builds: its fields (``flatten`` as in ``flat_fields``), or only the
    ones named in ``only``."""

    config: type
    flatten: tuple[str, ...] = ()
    only: tuple[str, ...] | None = None


def part_fields(parts: Sequence[Part]) -> list[tuple[dataclasses.Field, Any]]:
    """(field, type hint) of every part, in order; ``AssertionError`` when two parts name one field."""
    out: dict[str, tuple[dataclasses.Field, Any]] = {}
    for part in parts:
        for f, annotation in flat_fields(part.config, part.flatten):
            if part.only is None or f.name in part.only:
                assert f.name not in out, f"two configs have a field {f.name!r}"
                out[f.name] = (f, annotation)
    return list(out.values())


class FlatKeywords:
    """The keywords of a flat door: every field of its configs by name; ``build`` makes the configs.

    ``defaults`` gives the door its own default for a field (a dataset's base seed). ``document``
    writes the keywords into the door's signature and docstring (``help(PackedDataset)``).
    """

    def __init__(self, door: str, parts: Sequence[Part], defaults: Mapping[str, Any] | None = None) -> None:
        self.door, self.parts, self.defaults = door, tuple(parts), dict(defaults or {})
        self.fields = {f.name: f for f, _ in part_fields(self.parts)}

    def default(self, name: str) -> Any:
        return self.defaults[name] if name in self.defaults else _default(self.fields[name])

    def build(self, **keywords: Any) -> tuple[Any, ...]:
        """One config per part, from ``keywords`` and the defaults; ``TypeError`` for a keyword that
        is no field's (the configs' own checks reject bad values)."""
        unknown = sorted(set(keywords) - set(self.fields))
        if unknown:
            raise TypeError(
                f"{self.door}() got an unexpected keyword argument {unknown[0]!r}; it takes {', '.join(self.fields)}"
            )
        values = {**self.defaults, **keywords}
        return tuple(from_flat(part.config, values, part.flatten) for part in self.parts)

    def document(self, door: F) -> F:
        """``door`` (whose ``**keywords`` are these) with its signature listing every keyword and its
        default, and its docstring their help."""
        signature = inspect.signature(door)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        taken = {p.name for p in own}
        names = [name for name in self.fields if name not in taken]
        keyword = inspect.Parameter.KEYWORD_ONLY
        generated = [inspect.Parameter(name, keyword, default=self.default(name)) for name in names]
        door.__signature__ = signature.replace(parameters=[*own, *generated])  # type: ignore[attr-defined]
        doc = inspect.cleandoc(door.__doc__ or "")
        lines = [f"Keywords (the fields of {', '.join(p.config.__name__ for p in self.parts)}):"]
        for name in names:
            text = f"{name}={self.default(name)!r}: {field_help(self.fields[name])}"
            lines += textwrap.wrap(text, 96, initial_indent="    ", subsequent_indent="        ")
        door.__doc__ = f"{doc}\n\n" + "\n".join(lines)
        return door


# -- dataclass twins ----------------------------------------------------------------------------
def twin(
    parts: Sequence[Part],
    *,
    name: str,
    module: str,
    exclude: Collection[str] = (),
    defaults: Mapping[str, Any] | None = None,
    notes: Mapping[str, str] | None = None,
    extra: Sequence[tuple[str, Any, dataclasses.Field]] = (),
    hint: Callable[[Any], Any] = lambda h: h,
    frozen: bool = False,
    bases: tuple[type, ...] = (),
    namespace: Mapping[str, Any] | None = None,
    doc: str | None = None,
) -> type:
    """A kw_only dataclass ``name`` with the fields of ``parts`` (as ``FlatKeywords``), their help and
    checks, but for those in ``exclude``.

    ``defaults`` replaces a field's default (None makes the field optional: ``T | None``, its check
    letting None through); ``notes`` adds to a field's help; ``extra`` appends ``(name, type,
    dataclasses.field(...))`` fields; ``hint`` maps each field's type (Hydra's ``str`` for a
    ``Literal``); ``bases`` and ``namespace`` give it methods. The fields' metadata holds their
    help only (transformers' ``HfArgumentParser`` passes it to ``argparse``); their checks are the
    class attribute ``field_checks``, run where a base's ``__post_init__`` runs them
    (``check_fields(self, self.field_checks)``).
    """
    defaults, notes = dict(defaults or {}), dict(notes or {})
    members: list[tuple[str, Any, dataclasses.Field]] = []
    for f, annotation in part_fields(parts):
        if f.name in exclude:
            continue
        check = f.metadata.get("check")
        spec: dict[str, Any] = {}
        if f.name in defaults:
            spec["default"] = defaults[f.name]
            if defaults[f.name] is None and _default(f) is not None:
                annotation, check = annotation | None, check and optional(check)
        elif f.default is not dataclasses.MISSING:
            spec["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            spec["default_factory"] = f.default_factory
        text = " ".join(filter(None, (field_help(f), notes.get(f.name))))
        members.append((f.name, hint(annotation), setting(text, check=check, **spec)))
    members += extra
    made = dataclasses.make_dataclass(
        name,
        [(member, annotation, _help_only(f)) for member, annotation, f in members],
        bases=bases,
        namespace={
            **(namespace or {}),
            "field_checks": {n: f.metadata["check"] for n, _, f in members if f.metadata.get("check")},
        },
        frozen=frozen,
        kw_only=True,
    )
    made.__module__, made.__doc__ = module, doc or made.__doc__
    return made


def config_of(config: type) -> Callable[[str, Any], Any]:
    """The check of a field holding a ``config``: an instance, or a mapping of its settings (as YAML
    or a command line gives it) made into one, whose own checks then apply."""
    names = [f.name for f in dataclasses.fields(config) if f.init]

    def check(name: str, value: Any) -> Any:
        if isinstance(value, config):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(
                f"{name} must be an instance of {config.__name__} or a mapping of its settings, "
                f"got {type(value).__name__}"
            )
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise TypeError(
                f"{name}: {config.__name__} has no setting {unknown[0]!r}; its settings: {', '.join(names)}"
            )
        return config(**value)

    return check


def _help_only(f: dataclasses.Field) -> dataclasses.Field:
    """``f`` with its help as its only metadata."""
    spec = {"default": f.default, "default_factory": f.default_factory}
    spec = {k: v for k, v in spec.items() if v is not dataclasses.MISSING}
    return dataclasses.field(**spec, metadata={"help": field_help(f)})


def literal_as_str(annotation: Any) -> Any:
    """``annotation`` with every ``Literal[...]`` replaced by ``str`` (inside Optional / unions too)."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return str
    if origin in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, [literal_as_str(a) for a in typing.get_args(annotation)])
    return annotation


# -- command-line options -----------------------------------------------------------------------
def _scalar(annotation: Any) -> Any:
    """``annotation`` without ``| None``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    return annotation


def add_options(
    parser: argparse.ArgumentParser,
    config: type,
    *,
    only: Collection[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    many: Collection[str] = (),
    more_choices: Mapping[str, Sequence[str]] | None = None,
    notes: Mapping[str, str] | None = None,
) -> None:
    """One option per field of ``config`` (``--pack-size`` for ``pack_size``; only those in ``only``),
    with the field's help, its default (or ``defaults``'), the choices of a ``Literal`` and
    ``--x / --no-x`` for a ``bool``; a field without a default is required. The fields in ``many``
    take one or more values (a list; ``more_choices`` adds choices such as ``all``). The values are
    checked when the config is made (``from_flat(config, vars(args))``), with its own messages."""
    defaults, more_choices, notes = dict(defaults or {}), dict(more_choices or {}), dict(notes or {})
    for f, annotation in flat_fields(config):
        if only is not None and f.name not in only:
            continue
        kind = _scalar(annotation)
        text = " ".join(filter(None, (field_help(f), notes.get(f.name))))
        spec: dict[str, Any] = {"dest": f.name}
        if kind is bool:
            spec["action"] = argparse.BooleanOptionalAction
        else:
            choices = typing.get_args(kind) if typing.get_origin(kind) is Literal else None
            spec["type"] = type(choices[0]) if choices else kind
            if choices:
                spec["choices"] = [*choices, *more_choices.get(f.name, ())]
            if f.name in many:
                spec["nargs"] = "+"
        default = defaults[f.name] if f.name in defaults else _default(f)
        if default is dataclasses.MISSING:
            spec["required"] = True
        else:
            spec["default"] = default
            text += f" (default: {_shown(default)})"
        parser.add_argument("--" + f.name.replace("_", "-"), help=text.replace("%", "%%"), **spec)
