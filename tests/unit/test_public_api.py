"""The public surface: every exported name resolves, and planning does not pull in torch."""

from __future__ import annotations

import subprocess
import sys

import thdpack


def test_every_exported_name_resolves():
    for name in thdpack.__all__:
        assert getattr(thdpack, name) is not None


def test_planning_does_not_import_torch():
    code = (
        "import sys, thdpack; from thdpack.plan import plan_packs; plan_packs([3, 4], 8); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
