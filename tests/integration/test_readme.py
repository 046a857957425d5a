"""README.md stays true: its Python quickstart runs, its script fragments compile, and the files and
commands it names exist."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_quickstart_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python block"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_script_fragments_compile():
    """``py`` blocks are fragments of launched scripts (the model and data are the reader's): they
    cannot run here, but they must stay valid Python."""
    blocks = re.findall(r"```py\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no py block"
    for block in blocks:
        compile(block, "README.md", "exec")


def test_named_scripts_and_configs_exist():
    text = README.read_text()
    root = README.parent
    for path in re.findall(r"`((?:scripts|launch|configs|benchmarks|examples)/[\w./-]+\.(?:sh|sbatch|yaml|py))`", text):
        assert (root / path).exists(), path
    for path in re.findall(r"bash (scripts/\w+\.sh)", text):
        assert (root / path).exists(), path
    for path in re.findall(r"torchrun --nproc-per-node \d+ (examples/[\w/]+\.py)", text):
        assert (root / path).exists(), path
