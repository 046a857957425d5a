"""The benchmark scripts import each other one way: no script's import (lazy ones included) leads
back to it."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def script_imports(folder: Path) -> dict[str, set[str]]:
    """script -> the scripts of ``folder`` it imports, at any depth of its code."""
    scripts = {path.stem: path for path in folder.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in scripts.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module)
        graph[name] = {f for f in found if f in scripts and f != name}
    return graph


def cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path of imports from ``start`` back to it, or None."""
    todo, seen = [[start]], set()
    while todo:
        path = todo.pop()
        for nxt in sorted(graph[path[-1]]):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                todo.append([*path, nxt])
    return None


def test_no_benchmark_script_imports_itself_back():
    graph = script_imports(BENCH)
    assert "cp_throughput" in graph["train_throughput"]  # the lazy import of --cp is seen
    cycles = {name: cycle for name in sorted(graph) if (cycle := cycle_through(graph, name))}
    assert cycles == {}


def test_the_check_can_fail(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import g\n")  # a lazy import counts
    (tmp_path / "c.py").write_text("import a\n")
    graph = script_imports(tmp_path)
    assert cycle_through(graph, "a") == ["a", "b", "a"] and cycle_through(graph, "c") is None
