"""No import cycle between the modules of the THD, CP, attention, compat and model packages, counting
each package's ``__init__`` as a module: ``from thdpack.attention import flash_kernel`` runs
``attention/__init__.py``, which imports the package's modules back."""

from __future__ import annotations

from test_public_api import import_graph

PACKAGES = ("thdpack.thd", "thdpack.cp", "thdpack.attention", "thdpack.compat", "thdpack.models", "thdpack.loss")


def module_cycle(graph: dict[str, set[str]], within: tuple[str, ...]) -> list[str] | None:
    """A cycle of modules (package ``__init__`` files included) through a module of ``within``, or None."""
    for start in sorted(graph):
        if not start.startswith(within):
            continue
        came_from: dict[str, str] = {}
        frontier = [start]
        while frontier:  # breadth first: the shortest way back to ``start``
            node = frontier.pop(0)
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if nxt not in came_from:
                    came_from[nxt] = node
                    frontier.append(nxt)
    return None


def test_no_module_imports_back_into_its_package_face():
    assert module_cycle(import_graph(), PACKAGES) is None


def test_the_module_cycle_check_can_fail():
    graph = {
        "thdpack.attention": {"thdpack.attention.ring"},
        "thdpack.attention.ring": {"thdpack.attention"},  # `from thdpack.attention import flash_kernel`
    }
    assert module_cycle(graph, PACKAGES) == ["thdpack.attention", "thdpack.attention.ring", "thdpack.attention"]
