"""A griffe extension: thdpack's docstrings as the API reference renders them.

thdpack writes doctests inline (``>>>`` lines, run by pytest) and names objects with reST roles
(``:class:`~thdpack.cp.CpTopology```). Markdown would read a doctest as nested quotes and a role
as text, so each doctest block becomes a ``pycon`` code block and each role its code name.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|obj):`(~?)([\w.]+)`")


def _role(match: re.Match) -> str:
    short, path = match.groups()
    return f"`{path.rpartition('.')[2] if short else path}`"


def markdown(text: str) -> str:
    """``text`` with every doctest block fenced and every reST role as inline code."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(">>>"):
            indent = line[: len(line) - len(line.lstrip())]
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
                i += 1
            out += [f"{indent}```pycon", *(indent + b for b in block), f"{indent}```"]
            continue
        out.append(ROLE.sub(_role, line))
        i += 1
    return "\n".join(out)


class DoctestsAsCode(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
