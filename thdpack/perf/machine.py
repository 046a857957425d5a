"""MachineProfile: the public constants of one machine that the step-time model runs on.

A profile is plain JSON (``thdpack/perf/profiles/<name>.json``, or any path) with a strict schema:
every key known, every number finite and non-negative, and every number citing its source
(``sources``: a datasheet, a paper's figure, a published benchmark, or a placeholder that
``thdpack calibrate`` replaces by a measurement). docs/design/step_model.md ("Profiles and their
sources") lists the numbers and where each comes from.

>>> profile = load_profile("h100_sxm")
>>> profile.peak_flops, profile.gpus_per_node
(989500000000000.0, 8)
>>> sorted(PROFILE_NAMES)
['a100_sxm_80gb', 'cpu_gloo', 'gb200_nvl72', 'h100_sxm', 'h200_sxm']
>>> MachineProfile.from_dict({**profile.to_dict(), "peak_flopz": 1.0})
Traceback (most recent call last):
...
ValueError: profile 'h100_sxm': unknown key 'peak_flopz'; valid keys: attention, collective_base_latency_s, ...
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
PROFILE_NAMES: tuple[str, ...] = tuple(sorted(p.stem for p in PROFILE_DIR.glob("*.json")))
COLLECTIVES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class Link:
    """One kind of link between two GPUs."""

    bandwidth: float
    """Bytes per second one GPU sends in one direction."""
    latency_s: float
    """Seconds per hop (one step of a ring, one send)."""


@dataclass(frozen=True)
class AttentionKernel:
    """The attention kernel's speed against the length of the sequences one call runs on."""

    tile: int
    """Rows and columns of the kernel's tile; below the shortest measured length a sequence costs
    whole tiles (``thdpack.perf.kernels``)."""
    call_overhead_s: float
    """Fixed seconds of one kernel call (launch and ramp), whatever it computes."""
    forward_causal: tuple[tuple[float, float], ...]
    """``(sequence length, achieved FLOP/s)`` of the causal forward, lengths ascending."""
    forward_full: tuple[tuple[float, float], ...]
    """The same for a full (non-causal) block."""
    backward: tuple[tuple[float, float], ...]
    """The same for the backward (FLOPs counted as 2.5x the forward's)."""


@dataclass(frozen=True)
class HostCost:
    """What one eager op costs the host that issues it."""

    op_s: float
    """Seconds of one eager op on the host: Python, the dispatcher, autograd's bookkeeping, the launch.
    CPU-bound: a property of the host's CPU, not of the GPU."""
    asynchronous: bool
    """The device runs the ops while the host issues the next ones (a GPU), rather than the host
    computing them itself (a CPU)."""


@dataclass(frozen=True)
class Source:
    """Where the numbers under ``keys`` come from."""

    keys: tuple[str, ...]
    """Dotted keys of the profile this source gives (``"intra_node.bandwidth"``)."""
    source: str
    """What it is: a datasheet, a paper and its figure or table, a benchmark."""
    url: str
    """Where to read it (empty for a placeholder)."""
    where: str
    """The figure, table or line, and how the number follows from it."""


@dataclass(frozen=True)
class MachineProfile:
    """The constants of one machine (see the module docstring); ``load_profile`` reads one."""

    name: str
    description: str
    peak_flops: float
    matmul_efficiency: float
    memory_bandwidth: float
    attention: AttentionKernel
    intra_node: Link
    inter_node: Link
    collective_base_latency_s: float
    gpus_per_node: int
    nvlink_domain: int
    collective_factors: Mapping[str, float]
    host: HostCost
    sources: tuple[Source, ...]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MachineProfile:
        """The profile of a parsed JSON object; ``ValueError`` naming the key for anything the
        schema refuses (unknown, missing, not a number, negative, not finite, not cited)."""
        name = data.get("name", "?") if isinstance(data, Mapping) else "?"
        check = _Checker(f"profile {name!r}")
        check.keys(data, _SCHEMA, "")
        attention = data["attention"]
        profile = cls(
            name=check.text(data, "name"),
            description=check.text(data, "description"),
            peak_flops=check.number(data, "peak_flops", positive=True),
            matmul_efficiency=check.fraction(data, "matmul_efficiency"),
            memory_bandwidth=check.number(data, "memory_bandwidth", positive=True),
            attention=AttentionKernel(
                tile=check.integer(attention, "attention.tile"),
                call_overhead_s=check.number(attention, "attention.call_overhead_s"),
                forward_causal=check.curve(attention, "attention.forward_causal"),
                forward_full=check.curve(attention, "attention.forward_full"),
                backward=check.curve(attention, "attention.backward"),
            ),
            intra_node=_link(check, data, "intra_node"),
            inter_node=_link(check, data, "inter_node"),
            collective_base_latency_s=check.number(data, "collective_base_latency_s"),
            gpus_per_node=check.integer(data, "gpus_per_node"),
            nvlink_domain=check.integer(data, "nvlink_domain"),
            collective_factors={
                c: check.number(data["collective_factors"], f"collective_factors.{c}") for c in COLLECTIVES
            },
            host=HostCost(
                op_s=check.number(data["host"], "host.op_s", positive=True),
                asynchronous=check.flag(data["host"], "host.asynchronous"),
            ),
            sources=tuple(check.source(s, i) for i, s in enumerate(data["sources"])),
        )
        if profile.nvlink_domain % profile.gpus_per_node:
            raise ValueError(
                f"{check.where}: nvlink_domain={profile.nvlink_domain} is not a multiple of gpus_per_node="
                f"{profile.gpus_per_node}; an NVLink domain joins whole nodes"
            )
        cited = {key for s in profile.sources for key in s.keys}
        for key in _numeric_keys(_SCHEMA, ""):
            if key not in cited:
                raise ValueError(f"{check.where}: {key!r} cites no source; add it to the keys of an entry of 'sources'")
        unknown = sorted(cited - set(_numeric_keys(_SCHEMA, "")))
        if unknown:
            raise ValueError(f"{check.where}: sources cite {unknown[0]!r}, which is not a number of the profile")
        return profile

    def to_dict(self) -> dict[str, Any]:
        """The profile as the JSON object ``from_dict`` reads (what ``thdpack calibrate`` writes)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (Link, AttentionKernel, HostCost)):
                value = {g.name: _plain(getattr(value, g.name)) for g in fields(value)}
            elif f.name == "sources":
                value = [{g.name: _plain(getattr(s, g.name)) for g in fields(s)} for s in value]
            else:
                value = _plain(value)
            out[f.name] = value
        return out

    def to_json(self, path: str | Path) -> None:
        """Write the profile as JSON (read back by ``load_profile(path)``)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def load_profile(name_or_path: str | Path) -> MachineProfile:
    """A shipped profile by name (``PROFILE_NAMES``) or a profile JSON file by path.

    Args:
        name_or_path: a name of ``PROFILE_NAMES``, or the path of a profile JSON file (what
            ``thdpack calibrate`` writes).

    Returns:
        The ``MachineProfile``, checked against the schema (``ValueError`` naming the key or value).

    >>> load_profile("h300")
    Traceback (most recent call last):
    ...
    ValueError: unknown profile 'h300': not a file, and not one of a100_sxm_80gb, cpu_gloo, gb200_nvl72, ...
    """
    path = Path(name_or_path)
    if not path.is_file():
        if str(name_or_path) not in PROFILE_NAMES:
            raise ValueError(
                f"unknown profile {str(name_or_path)!r}: not a file, and not one of {', '.join(PROFILE_NAMES)}"
            )
        path = PROFILE_DIR / f"{name_or_path}.json"
    return MachineProfile.from_dict(read_json_object(path, "profile"))


def read_json_object(path: Path, what: str) -> Mapping[str, Any]:
    """The JSON object in ``path``; ``ValueError`` naming ``what`` and the file otherwise."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} {path}: not valid JSON ({err})") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} {path}: the file holds a {type(data).__name__}, not a JSON object")
    return data


# The schema: key -> a nested schema (dict) or the kind of value
_LINK = {"bandwidth": "number", "latency_s": "number"}
_SCHEMA: dict[str, Any] = {
    "name": "text",
    "description": "text",
    "peak_flops": "number",
    "matmul_efficiency": "number",
    "memory_bandwidth": "number",
    "attention": {
        "tile": "number",
        "call_overhead_s": "number",
        "forward_causal": "curve",
        "forward_full": "curve",
        "backward": "curve",
    },
    "intra_node": _LINK,
    "inter_node": _LINK,
    "collective_base_latency_s": "number",
    "gpus_per_node": "number",
    "nvlink_domain": "number",
    "collective_factors": dict.fromkeys(COLLECTIVES, "number"),
    "host": {"op_s": "number", "asynchronous": "flag"},
    "sources": "sources",
}
_SOURCE_KEYS = ("keys", "source", "url", "where")


def _numeric_keys(schema: Mapping[str, Any], prefix: str) -> list[str]:
    """Dotted keys of every number and curve of the schema: what a source must cite."""
    out = []
    for key, kind in schema.items():
        if isinstance(kind, dict):
            out += _numeric_keys(kind, f"{prefix}{key}.")
        elif kind in ("number", "curve"):
            out.append(prefix + key)
    return out


def _link(check: _Checker, data: Mapping[str, Any], key: str) -> Link:
    return Link(
        bandwidth=check.number(data[key], f"{key}.bandwidth", positive=True),
        latency_s=check.number(data[key], f"{key}.latency_s"),
    )


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return dict(value)
    return value


class _Checker:
    """The schema's checks, each naming the profile and the dotted key."""

    def __init__(self, where: str) -> None:
        self.where = where

    def keys(self, data: object, schema: Mapping[str, Any], prefix: str) -> None:
        if not isinstance(data, Mapping):
            raise ValueError(f"{self.where}: {prefix.rstrip('.') or 'the profile'} must be a JSON object")
        for key in data:
            if key not in schema:
                raise ValueError(f"{self.where}: unknown key {prefix + key!r}; valid keys: {', '.join(sorted(schema))}")
        for key, kind in schema.items():
            if key not in data:
                raise ValueError(f"{self.where}: missing key {prefix + key!r}")
            if isinstance(kind, dict):
                self.keys(data[key], kind, f"{prefix}{key}.")

    def text(self, data: Mapping[str, Any], key: str) -> str:
        value = data[key.rsplit(".", 1)[-1]]
        if not isinstance(value, str):
            raise ValueError(f"{self.where}: {key!r} must be a string, got {value!r}")
        return value

    def number(self, data: Mapping[str, Any], key: str, positive: bool = False) -> float:
        value = data[key.rsplit(".", 1)[-1]]
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{self.where}: {key!r} must be a number, got {value!r}")
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            bound = "> 0" if positive else ">= 0"
            raise ValueError(f"{self.where}: {key!r} must be a finite number {bound}, got {value!r}")
        return float(value)

    def flag(self, data: Mapping[str, Any], key: str) -> bool:
        value = data[key.rsplit(".", 1)[-1]]
        if not isinstance(value, bool):
            raise ValueError(f"{self.where}: {key!r} must be true or false, got {value!r}")
        return value

    def fraction(self, data: Mapping[str, Any], key: str) -> float:
        value = self.number(data, key, positive=True)
        if value > 1:
            raise ValueError(f"{self.where}: {key!r} is a fraction of the peak, in (0, 1]; got {value!r}")
        return value

    def integer(self, data: Mapping[str, Any], key: str) -> int:
        value = self.number(data, key, positive=True)
        if value != int(value):
            raise ValueError(f"{self.where}: {key!r} must be a whole number, got {value!r}")
        return int(value)

    def curve(self, data: Mapping[str, Any], key: str) -> tuple[tuple[float, float], ...]:
        points = data[key.rsplit(".", 1)[-1]]
        if not isinstance(points, list) or not points:
            raise ValueError(f"{self.where}: {key!r} must be a non-empty list of [length, FLOP/s] pairs")
        out = []
        for i, point in enumerate(points):
            if not isinstance(point, list) or len(point) != 2:
                raise ValueError(f"{self.where}: {key}[{i}] must be a [length, FLOP/s] pair, got {point!r}")
            pair = {"length": point[0], "flops": point[1]}
            out.append((self.number(pair, f"{key}[{i}].length", True), self.number(pair, f"{key}[{i}].flops", True)))
        lengths = [p[0] for p in out]
        if lengths != sorted(set(lengths)):
            raise ValueError(f"{self.where}: {key!r} lengths must rise strictly, got {lengths}")
        return tuple(out)

    def source(self, entry: object, i: int) -> Source:
        where = f"sources[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{self.where}: {where} must be a JSON object with keys {', '.join(_SOURCE_KEYS)}")
        for key in entry:
            if key not in _SOURCE_KEYS:
                raise ValueError(f"{self.where}: unknown key '{where}.{key}'; valid keys: {', '.join(_SOURCE_KEYS)}")
        for key in _SOURCE_KEYS:
            if key not in entry:
                raise ValueError(f"{self.where}: missing key '{where}.{key}'")
        keys = entry["keys"]
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
            raise ValueError(f"{self.where}: '{where}.keys' must be a non-empty list of dotted keys")
        texts = [self.text(entry, f"{where}.{k}") for k in ("source", "url", "where")]
        return Source(tuple(keys), *texts)
