"""The documentation stays true: its code runs, its generated parts cover the code, its names exist.

- Every ``python`` block of a page runs, the page's blocks in order in one namespace (a guide
  builds up step by step). A block that starts ``# needs: <reason>`` is not run in-process: a
  script (``if __name__ == "__main__":``) runs in its own process, since it starts several; any
  other such block (a GPU, a launcher) must give its reason and compile.
- ``py`` blocks are fragments of launched scripts: they compile.
- The scripts, configs and ``thdpack`` commands the pages name exist.
- Every ``{{ key }}`` placeholder resolves, the config reference lists every Hydra key and every
  component field, and the API reference has one entry per public name.

The site itself is built by ``.ci/run`` (``mkdocs build --strict``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
sys.path.insert(0, str(DOCS))

from gen import api, config_reference, placeholders  # noqa: E402

# benchmark outputs kept beside their JSON, not pages (mkdocs.yml's exclude_docs)
RAW = ("performance/*_cpu.md", "performance/*_rerun.md")
PAGES = sorted(p for p in DOCS.rglob("*.md") if not any(p.relative_to(DOCS).match(raw) for raw in RAW))
NEEDS = "# needs: "


def blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", page.read_text(), flags=re.S)


def page_id(page: Path) -> str:
    return str(page.relative_to(DOCS))


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "python")], ids=page_id)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "docs"}
    for block in blocks(page, "python"):
        code = compile(block, str(page), "exec")
        if block.startswith(NEEDS):
            assert len(block.splitlines()[0]) > len(NEEDS) + 5, f"{page}: say what the block needs and why"
            continue
        exec(code, namespace)


SCRIPTS = [(p, b) for p in PAGES for b in blocks(p, "python") if b.startswith(NEEDS) and '__name__ == "__main__"' in b]


@pytest.mark.distributed
@pytest.mark.parametrize(("page", "block"), SCRIPTS, ids=[page_id(p) for p, _ in SCRIPTS])
def test_multi_process_blocks_run(page, block, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(block)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{page}: exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "py")], ids=page_id)
def test_script_fragments_compile(page):
    for block in blocks(page, "py"):
        compile(block, str(page), "exec")


def test_named_files_and_commands_exist():
    from thdpack.cli import COMMANDS

    for page in PAGES:
        text = page.read_text()
        for path in re.findall(
            r"`((?:scripts|launch|configs|benchmarks|examples)/[\w./-]+\.(?:sh|sbatch|yaml|py))", text
        ):
            assert (REPO / path).exists(), f"{page_id(page)} names {path}"
        for command in re.findall(r"^\s*thdpack (\w+)", "\n".join(blocks(page, "bash")), flags=re.M):
            assert command in COMMANDS, f"{page_id(page)} runs `thdpack {command}`"


def test_every_placeholder_resolves():
    for page in PAGES:
        for key in placeholders.PLACEHOLDER.findall(page.read_text()):
            assert placeholders.value(key).strip(), f"{page_id(page)}: {{{{ {key} }}}} is empty"


def test_config_reference_has_every_key():
    text = config_reference.hydra_groups()
    for group in ("data", "model", "packing", "parallel", "attention", "train"):
        for key in config_reference.group_keys(group):
            assert f"`{group}.{key}`" in text
    components = config_reference.components()
    for public, module in config_reference.COMPONENTS:
        cls = getattr(__import__(module, fromlist=["_"]), public.rpartition(".")[2])
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in components, f"{public}.{f.name}"
    commands = config_reference.commands()
    assert "`--pack-size`" in commands and "`--cp-placement`" in commands


def test_api_reference_has_every_public_name():
    pages = dict(api.pages())
    rendered = "\n".join(pages.values())
    for page in api.PAGES:
        for item in api.names(page.module):
            assert f"{item.module}.{item.name}" in rendered, f"{item.module}.{item.name}"
    for name in api.exported("thdpack"):
        if name != "__version__":
            assert f"`thdpack.{name}`" in pages["reference/api/index.md"], name
