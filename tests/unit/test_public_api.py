"""The public surface: every exported name of every package resolves, star-imports work in a
fresh interpreter, the package has no import cycle, and planning does not pull in torch."""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import thdpack

PACKAGE_DIR = Path(thdpack.__file__).parent
# modules that need an optional extra to import at all
OPTIONAL = {
    "thdpack.train.__main__": "hydra",
    "thdpack.verify.__main__": "runs the command",
    # import transformers' Trainer / TRL when they load (the trl extra; ~6 s each, once per session)
    "thdpack.integrations.transformers": "trl",
    "thdpack.integrations.trl": "trl",
}


def _modules() -> list[str]:
    names = ["thdpack"]
    for info in pkgutil.walk_packages([str(PACKAGE_DIR)], prefix="thdpack."):
        names.append(info.name)
    return sorted(names)


def _packages() -> list[str]:
    return [name for name in _modules() if (PACKAGE_DIR.parent / name.replace(".", "/") / "__init__.py").exists()]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_every_package_exports_resolve_and_star_import_in_a_fresh_interpreter():
    """``from P import *`` and ``getattr(P, name)`` for every name of every package's ``__all__``."""
    code = f"""
import importlib, json
missing = {{}}
for package in {_packages()!r}:
    module = importlib.import_module(package)
    names = getattr(module, "__all__", None)
    if names is None:
        continue
    namespace = {{}}
    exec(f"from {{package}} import *", namespace)
    absent = [n for n in names if n not in namespace or not hasattr(module, n)]
    if absent:
        missing[package] = absent
print(json.dumps(missing))
"""
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


def test_a_missing_export_is_caught():
    """The check above can fail: a name in ``__all__`` that the package lacks."""
    out = _run("import thdpack.thd as m; m.__all__ = [*m.__all__, 'nope']; exec('from thdpack.thd import *')")
    assert out.returncode != 0 and "nope" in out.stderr


@pytest.mark.parametrize(
    "first", ["thdpack.attention", "thdpack.cp", "thdpack.thd", "thdpack.packing", "thdpack.verify"]
)
def test_every_module_imports_first_in_a_fresh_interpreter(first):
    """Import order cannot matter: start from each stage, then import every other module."""
    skip = sorted(OPTIONAL)
    code = f"""
import importlib
importlib.import_module({first!r})
for name in {_modules()!r}:
    if name not in {skip!r}:
        importlib.import_module(name)
"""
    out = _run(code)
    assert out.returncode == 0, out.stderr


def _imports(path: Path, module: str) -> set[str]:
    """Every thdpack module ``module`` imports, at any depth of its code (lazy imports included)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                base = module.rsplit(".", node.level)[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("thdpack")}


def import_graph() -> dict[str, set[str]]:
    """module -> the thdpack modules it imports (names resolved to existing modules)."""
    modules = set(_modules())
    graph = {}
    for name in modules:
        parts = name.split(".")
        path = PACKAGE_DIR.parent.joinpath(*parts)
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        targets = set()
        for target in _imports(path, name):
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]  # `from thdpack.plan import plan_packs` -> thdpack.plan
            if target in modules and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def _stage(module: str) -> str:
    return ".".join(module.split(".")[:2])


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle between subpackages (a package importing its own modules is not one), or None."""
    stages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        stages.setdefault(_stage(module), set()).update(_stage(t) for t in targets if _stage(t) != _stage(module))
    stages.pop("thdpack", None)  # the root only re-exports lazily
    for stage in stages:
        stages[stage].discard("thdpack")
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(stages.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
            if state.get(nxt) is None:
                found = visit(nxt, [*path, nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(stages):
        if state.get(start) is None:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_no_import_cycle_between_stages():
    """plan -> packing -> thd -> cp -> attention -> models -> verify / train: dependencies point one way."""
    assert find_cycle(import_graph()) is None


def test_the_cycle_check_can_fail():
    graph = {"thdpack.cp.a": {"thdpack.attention.b"}, "thdpack.attention.b": {"thdpack.cp.partition"}}
    assert find_cycle(graph) == ["thdpack.attention", "thdpack.cp", "thdpack.attention"] or find_cycle(graph) == [
        "thdpack.cp",
        "thdpack.attention",
        "thdpack.cp",
    ]


def test_old_module_paths_still_import():
    out = _run(
        "import thdpack.packer, thdpack.thd_format, thdpack.masks, thdpack.report, thdpack.layout; "
        "from thdpack.packed_dataset import PackedDataset; from thdpack.streaming import StreamingPacker; "
        "from thdpack.packer import assemble_pack; import thdpack; print(thdpack.layout.IGNORE_INDEX, "
        "thdpack.read_sample.__module__)"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["-100", "thdpack.packing.packer"]


def test_root_exports_only_what_users_call():
    internals = {"assemble_pack", "read_sample", "layout_mask", "segment_ids", "TokenLayout", "token_layout"}
    assert not internals & set(thdpack.__all__)


def test_planning_does_not_import_torch():
    code = (
        "import sys, thdpack; from thdpack.plan import plan_packs; plan_packs([3, 4], 8); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
