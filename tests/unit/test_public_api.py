"""The public surface: the front door's names (``thdpack.__all__``), every exported name of every
package resolves and has one home, star-imports work in a fresh interpreter, no module imports
through the top face, no import cycle (package ``__init__`` files and the benchmark scripts
counted), and ``import thdpack`` / planning do not pull in torch."""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import thdpack

PACKAGE_DIR = Path(thdpack.__file__).parent
BENCH_DIR = PACKAGE_DIR.parent / "benchmarks"
FRONT_DOOR = {
    "__version__",
    # planning (numpy only: imported with the package)
    "plan_packs",
    "PlanConfig",
    "PackPlan",
    "PackingStats",
    "IGNORE_INDEX",
    # packs, THD batches, attention, loss (torch: imported on first use)
    "PackedDataset",
    "StreamingPacker",
    "collate",
    "to_thd",
    "thd_collate",
    "thd_attention",
    "StepLoss",
    "packed_cross_entropy",
    # token stores
    "TokenStore",
    "verify_store",
}
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
    """Every thdpack module ``module`` imports, at any depth of its code (lazy imports included,
    and ``importlib.import_module("thdpack....")`` with a literal name)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(node, module, path)
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif _is_import_module_call(node):
            found.add(node.args[0].value)  # type: ignore[attr-defined]
    return {name for name in found if name.startswith("thdpack")}


def _from_target(node: ast.ImportFrom, module: str, path: Path) -> str:
    if not node.level:  # absolute
        return node.module or ""
    base = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for _ in range(node.level - 1):
        base = base.rsplit(".", 1)[0]
    return f"{base}.{node.module}" if node.module else base


def _is_import_module_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    )


def _path(module: str) -> Path:
    path = PACKAGE_DIR.parent.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _resolve(name: str, modules: set[str]) -> str | None:
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]  # `from thdpack.plan import plan_packs` -> thdpack.plan
    return name if name in modules else None


def import_graph() -> dict[str, set[str]]:
    """module -> the thdpack modules it imports (names resolved to existing modules)."""
    modules = set(_modules())
    graph = {}
    for name in modules:
        targets = {_resolve(target, modules) for target in _imports(_path(name), name)}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def module_sources(bench_dir: Path = BENCH_DIR) -> dict[str, Path]:
    """module -> its file: thdpack's modules and the benchmark scripts (as ``benchmarks.<stem>``)."""
    sources = {name: _path(name) for name in _modules()}
    sources |= {f"benchmarks.{path.stem}": path for path in sorted(bench_dir.glob("*.py"))}
    return sources


def _resolve_in(name: str, importer: str, modules: set[str]) -> str | None:
    """``name`` as ``importer`` imports it: a benchmark script imports its siblings by their plain
    name (benchmarks/ is on its ``sys.path``)."""
    sibling = f"benchmarks.{name.split('.')[0]}"
    if importer.startswith("benchmarks.") and sibling in modules:
        return sibling
    return _resolve(name, modules)


def module_graph(sources: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """module -> the modules whose code runs when it is imported, package ``__init__`` files and
    benchmark scripts counted (``module_sources``):

    - ``import a.b.c`` / ``from a.b.c import x`` runs ``a.b.c`` and every package above it that is
      not also above the importing module (those are already being imported);
    - ``from P import name`` with ``P`` a package also runs (and reads) ``P``'s ``__init__``: it
      imports the package's face, even from inside ``P``, where the library imports modules;
    - imports inside functions count: a lazy import that leads back is a cycle the first call closes.
    """
    sources = module_sources() if sources is None else sources
    modules = set(sources)
    graph: dict[str, set[str]] = {}
    for name, path in sources.items():
        found: list[str | None] = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [_resolve_in(a.name, name, modules) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (source := _from_target(node, name, path)):
                package = _resolve_in(source, name, modules)
                found += [package, *(f"{package}.{a.name}" for a in node.names if f"{package}.{a.name}" in modules)]
            elif _is_import_module_call(node):
                found.append(_resolve(node.args[0].value, modules))  # type: ignore[attr-defined]
        own = set(_ancestors(name))
        targets = {module for module in found if module is not None}
        targets |= {a for module in targets for a in _ancestors(module) if a not in own and a in modules}
        graph[name] = targets - {name}
    return graph


def module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:  # Tarjan
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


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


def test_no_import_cycle_between_modules_package_inits_and_benchmarks_included():
    """No module's import runs code that imports it back, counting each package ``__init__`` as
    the module it is (a face import inside the package is an import of its ``__init__``) and the
    benchmark scripts, whose lazy imports of each other count too."""
    graph = module_graph()
    assert "benchmarks.cp_throughput" in graph["benchmarks.train_throughput"]  # a lazy import is seen
    assert "thdpack.plan" in graph["benchmarks.plan_bench"]  # and thdpack, through the face it imports
    cycles = module_cycles(graph)
    assert cycles == [], "\n".join(f"{len(c)} modules: {' -> '.join(c)}" for c in cycles)


def test_the_module_cycle_check_can_fail():
    """A face import inside a package is a cycle through its ``__init__``; a module import is not."""
    face = "from thdpack.packing import pack_layout"
    graph = {
        "thdpack.packing": {"thdpack.packing.dataset"},
        "thdpack.packing.dataset": {"thdpack.packing"},  # what `face` makes of it
        "thdpack.packing.pack_layout": set(),
    }
    assert module_cycles(graph) == [["thdpack.packing", "thdpack.packing.dataset"]], face
    graph["thdpack.packing.dataset"] = {"thdpack.packing.pack_layout"}
    assert module_cycles(graph) == []


def test_the_module_cycle_check_fails_on_a_planted_benchmark_cycle(tmp_path):
    """Benchmark scripts importing each other back (one of them lazily, as ``--cp`` modes do) are a
    cycle; a script importing thdpack and a sibling one way is not."""
    (tmp_path / "a.py").write_text("import b\nfrom thdpack.plan.api import plan_packs\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import g\n")
    (tmp_path / "c.py").write_text("import a\n")
    graph = module_graph(module_sources(tmp_path))
    assert graph["benchmarks.b"] == {"benchmarks.a"} and "thdpack.plan.api" in graph["benchmarks.a"]
    assert module_cycles(graph) == [["benchmarks.a", "benchmarks.b"]]
    (tmp_path / "b.py").write_text("import c\n")  # a -> b -> c -> a
    assert module_cycles(module_graph(module_sources(tmp_path))) == [["benchmarks.a", "benchmarks.b", "benchmarks.c"]]
    (tmp_path / "b.py").write_text("import json\n")
    assert module_cycles(module_graph(module_sources(tmp_path))) == []


def test_the_cycle_check_can_fail():
    graph = {"thdpack.cp.a": {"thdpack.attention.b"}, "thdpack.attention.b": {"thdpack.cp.partition"}}
    assert find_cycle(graph) == ["thdpack.attention", "thdpack.cp", "thdpack.attention"] or find_cycle(graph) == [
        "thdpack.cp",
        "thdpack.attention",
        "thdpack.cp",
    ]


def test_no_import_hook_and_modules_reload():
    """thdpack installs no finder: a path that is not a module does not import, and a real module
    keeps its own spec (``importlib.reload`` re-executes it)."""
    out = _run(
        "import importlib, sys, thdpack, thdpack.packing.packer as packer\n"
        "assert not any(type(f).__module__.startswith('thdpack') for f in sys.meta_path)\n"
        "assert packer.__spec__.name == 'thdpack.packing.packer'\n"
        "packer.mark = 1; importlib.reload(packer); assert packer.mark == 1 and packer.build_pack\n"
        "try:\n    import thdpack.packer\nexcept ModuleNotFoundError:\n    print('gone')\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["gone"]


def test_names_readme_and_the_contract_document_import_plainly():
    out = _run(
        "import thdpack\n"
        "from thdpack import plan_packs, PackPlan, PackingStats, PlanConfig, PackedDataset, collate, to_thd\n"
        "from thdpack import thd_collate, IGNORE_INDEX, StepLoss, thd_attention\n"
        "from thdpack.cp import partition_indices, shard, unshard\n"
        "from thdpack.compat.nemo import pack_dataset, packed_sequence_thd_collater, process_input_for_thd\n"
        "from thdpack.compat.nemo import split_batch_into_thd_chunks, make_cp_batch_for_te, create_block_causal_mask\n"
        "print(IGNORE_INDEX, PackedDataset.__module__)"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["-100", "thdpack.packing.dataset"]


def test_the_front_door():
    """``thdpack`` serves the names of the plan -> pack -> THD -> attention / loss path, CONTRACT's
    included; every other name lives in its stage's package."""
    assert set(thdpack.__all__) == FRONT_DOOR and len(thdpack.__all__) == len(FRONT_DOOR)
    for name in FRONT_DOOR:
        assert getattr(thdpack, name) is not None, name


def test_the_torch_names_are_visible_to_static_tools():
    """Each name ``__getattr__`` imports on first use is also imported under ``TYPE_CHECKING``,
    from the same module, and the eager imports plus those are the front door."""
    tree = ast.parse((PACKAGE_DIR / "__init__.py").read_text())
    eager, typed = set(), set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module not in ("__future__", "typing"):
            eager |= {(node.module, a.name) for a in node.names}
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            typed |= {(n.module, a.name) for n in node.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert typed == {(module, name) for name, module in thdpack._LAZY.items()}
    assert {name for _, name in eager | typed} == FRONT_DOOR


def test_import_thdpack_loads_neither_torch_nor_the_torch_names():
    code = (
        "import sys, thdpack\n"
        "print('torch' in sys.modules, sorted(n for n in thdpack._LAZY if n in vars(thdpack)), thdpack.PlanConfig.__name__)\n"
        "thdpack.thd_collate\n"
        "print('torch' in sys.modules)"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "[]", "PlanConfig", "True"]


def _face_imports(path: Path) -> dict[str, str]:
    """name -> the module a package face imports it from."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("thdpack"):
            found.update({alias.asname or alias.name: node.module for alias in node.names})
    return found


def test_every_exported_name_has_one_home():
    """A package exports only what its own modules define, and no name is exported by two packages
    (the front door aside): one path to each name."""
    homes: dict[str, list[str]] = {}
    for package in _packages():
        names = getattr(importlib.import_module(package), "__all__", None)
        if package == "thdpack" or names is None:
            continue
        imported = _face_imports(_path(package))
        for name in names:
            assert imported[name].startswith(f"{package}."), f"{package}.{name} comes from {imported[name]}"
            homes.setdefault(name, []).append(package)
    assert {name: where for name, where in homes.items() if len(where) > 1} == {}


def top_face_imports(path: Path, module: str) -> list[int]:
    """The lines where ``module`` imports a name through ``thdpack/__init__`` (``from thdpack import
    x``, or its relative twin from a top-level module), instead of from the module that defines it."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and _from_target(node, module, path) == "thdpack":
            lines.append(node.lineno)
    return lines


def test_no_module_imports_through_the_top_face():
    """The top face is for users: a module that imported through it would run (and depend on) the
    whole face, and ``from thdpack import _optional`` reads as a public name."""
    found = {name: lines for name, path in module_sources().items() if (lines := top_face_imports(path, name))}
    assert found == {}


def test_the_top_face_check_can_fail(tmp_path):
    module = tmp_path / "backend.py"
    module.write_text("import thdpack._optional as _optional\nfrom thdpack._version import __version__\n")
    assert top_face_imports(module, "thdpack.attention.backends.backend") == []
    module.write_text("import json\n\nfrom thdpack import _optional\n")
    assert top_face_imports(module, "thdpack.attention.backends.backend") == [3]
    module.write_text("from . import __version__\n")  # a top-level module's relative twin
    assert top_face_imports(module, "thdpack.cli") == [1]


def test_planning_does_not_import_torch():
    code = (
        "import sys, thdpack; from thdpack.plan import plan_packs; plan_packs([3, 4], 8); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
