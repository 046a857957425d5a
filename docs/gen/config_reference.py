"""The config reference: every Hydra key and every component setting, from the config dataclasses.

A field's help is its ``metadata["help"]`` (``thdpack._settings.setting``) or, for a plain
dataclass field, the docstring under it; its type and default come from the dataclass, and the
trainer's presets from ``configs/<group>/*.yaml``. A field without help fails the build.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import itertools
import textwrap
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"

# the one Hydra key whose help is nowhere in the code: the model group's switch between the two
# model kinds (thdpack.train.config.MODEL_KINDS), an extra field of the generated model node
EXTRA_HELP = {"kind": "Which model: 'thdpack' (thdpack's decoder, the size fields) or 'hf' (a Hugging Face causal LM)."}


@cache
def attribute_docs(cls: type) -> dict[str, str]:
    """The docstrings under ``cls``'s annotated fields (and its bases'), by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # built-ins, and classes made at run time (their help is metadata)
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in itertools.pairwise(body):
            named = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            if named and isinstance(after, ast.Expr) and isinstance(getattr(after, "value", None), ast.Constant):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def field_help(f: dataclasses.Field, sources: tuple[type, ...]) -> str:
    text = f.metadata.get("help") or next(
        (attribute_docs(s)[f.name] for s in sources if f.name in attribute_docs(s)), ""
    )
    text = text or EXTRA_HELP.get(f.name, "")
    if not text:
        raise KeyError(f"{sources[0].__name__}.{f.name} has no help: add a docstring under the field or setting(help)")
    return text


def type_name(hint: Any) -> str:
    """A type as a reader writes it: ``Literal['a', 'b']`` as ``'a' | 'b'``, ``X | None``."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in typing.get_args(hint))
    if origin is list:
        return f"list[{', '.join(type_name(a) for a in typing.get_args(hint))}]"
    if hint is type(None):
        return "None"
    return getattr(hint, "__name__", str(hint))


def default_of(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def shown(value: Any) -> str:
    """A value as YAML / a command-line override writes it."""
    if value is dataclasses.MISSING:
        return "required"
    if dataclasses.is_dataclass(value):
        return f"`{type(value).__name__}()`"
    return f"`{yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}`"


def cell(text: str) -> str:
    """``text`` on one table line: newlines joined, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)]) + "\n"


# -- the trainer's Hydra groups ---------------------------------------------------------------------
@cache
def default_presets() -> dict[str, str]:
    """group -> the preset configs/train.yaml composes."""
    defaults = yaml.safe_load((CONFIGS / "train.yaml").read_text())["defaults"]
    return {k: v for item in defaults if isinstance(item, dict) for k, v in item.items() if "/" not in k}


def presets(group: str) -> dict[str, dict[str, Any]]:
    return {p.stem: yaml.safe_load(p.read_text()) or {} for p in sorted((CONFIGS / group).glob("*.yaml"))}


def _group_sources() -> dict[str, tuple[type, tuple[type, ...]]]:
    """group -> (its Hydra node, the classes whose field docs describe it)."""
    from thdpack.attention.config import AttentionConfig
    from thdpack.models.config import ModelConfig
    from thdpack.models.hf.causal_lm import HFModelConfig
    from thdpack.packing.dataset import PackedDatasetConfig
    from thdpack.plan.config import PlanConfig
    from thdpack.train.config import Config

    documented = {
        "model": (ModelConfig, HFModelConfig),
        "packing": (PackedDatasetConfig, PlanConfig),
        "attention": (AttentionConfig,),
    }
    hints = typing.get_type_hints(Config)
    return {f.name: (hints[f.name], (hints[f.name], *documented.get(f.name, ()))) for f in dataclasses.fields(Config)}


def group_keys(group: str) -> list[str]:
    node, _ = _group_sources()[group]
    return [f.name for f in dataclasses.fields(node)]


def hydra_group(group: str) -> str:
    """One group's section: its presets, then a row per key (type, default, the presets' values, help)."""
    node, sources = _group_sources()[group]
    hints = typing.get_type_hints(node)
    component_hints: dict[str, Any] = {}
    for source in reversed(sources[1:]):
        component_hints.update(typing.get_type_hints(source))
    chosen = default_presets()[group]
    sets = presets(group)
    others = [name for name in sets if name != chosen]
    rows = []
    for f in dataclasses.fields(node):
        hint = component_hints.get(f.name, hints[f.name])
        default = sets[chosen].get(f.name, default_of(f))
        other = [
            f"{name}: {shown(sets[name][f.name])}"
            for name in others
            if f.name in sets[name] and sets[name][f.name] != default
        ]
        rows.append(
            [
                f"`{group}.{f.name}`",
                f"`{type_name(hint)}`",
                shown(default),
                cell(", ".join(other)),
                cell(field_help(f, sources)),
            ]
        )
    listing = ", ".join(f"`{group}={name}`" + (" (default)" if name == chosen else "") for name in sets)
    built = (
        " and ".join(f"`{s.__module__}.{s.__name__}`" for s in sources[1:]) or f"`{node.__module__}.{node.__name__}`"
    )
    head = f"### `{group}`\n\nPresets (`configs/{group}/`): {listing}. The fields of {built}.\n"
    return head + "\n" + _table(["key", "type", "default", "other presets", "meaning"], rows)


def hydra_groups() -> str:
    return "\n".join(hydra_group(group) for group in _group_sources())


# -- component configs -----------------------------------------------------------------------------
# (the name a user imports, where it is defined); HFModelConfig's size fields mean ModelConfig's
COMPONENTS = (
    ("thdpack.plan.PlanConfig", "thdpack.plan.config"),
    ("thdpack.packing.PackedDatasetConfig", "thdpack.packing.dataset"),
    ("thdpack.packing.StreamingPackerConfig", "thdpack.packing.streaming"),
    ("thdpack.packing.PackingRuntime", "thdpack.packing.runtime"),
    ("thdpack.attention.AttentionConfig", "thdpack.attention.config"),
    ("thdpack.models.ModelConfig", "thdpack.models.config"),
    ("thdpack.models.hf.HFModelConfig", "thdpack.models.hf.causal_lm"),
    ("thdpack.integrations.transformers.PackingArguments", "thdpack.integrations.packing_arguments"),
)


def component(public: str, module: str) -> str:
    cls = getattr(importlib.import_module(module), public.rpartition(".")[2])
    hints = typing.get_type_hints(cls)
    sources = (cls, *(_group_sources()["model"][1][1:2] if cls.__name__ == "HFModelConfig" else ()))
    rows = [
        [f"`{f.name}`", f"`{type_name(hints[f.name])}`", shown(default_of(f)), cell(field_help(f, sources))]
        for f in dataclasses.fields(cls)
        if f.init
    ]
    summary = cell(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0])
    return f"### `{public}`\n\n{summary}\n\n" + _table(["field", "type", "default", "meaning"], rows)


def components() -> str:
    return "\n".join(component(public, module) for public, module in COMPONENTS)


# -- command-line options ----------------------------------------------------------------------------
def _subparser(command: str) -> argparse.ArgumentParser:
    from thdpack.cli import build_parser

    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def command(command: str) -> str:
    from thdpack.cli import COMMANDS

    parser = _subparser(command)
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest.upper()}`"
        if action.choices:
            name += " " + "/".join(f"`{c}`" for c in action.choices)
        if action.required or action.default in (None, argparse.SUPPRESS):
            default = ""
        elif isinstance(action.default, list):
            default = "`" + " ".join(map(str, action.default)) + "`"
        else:
            default = f"`{action.default}`"
        rows.append([name, default, cell((action.help or "").replace("%%", "%"))])
    return f"## `thdpack {command}`\n\n{COMMANDS[command][0].capitalize()}.\n\n" + _table(
        ["option", "default", "meaning"], rows
    )


def commands() -> str:
    from thdpack.cli import COMMANDS

    return "\n".join(command(name) for name in COMMANDS)
