"""thdpack.layout imports and runs without torch (the numpy-only planner and data workers use it)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_layout_imports_and_runs_with_torch_blocked():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any import of torch now raises ImportError\n"
        "import numpy as np\n"
        "import thdpack.layout as layout\n"
        "pack = layout.PackPlacement.from_groups([6, 3, 1], {(0, 2): [0], (1, 1): [1], (0, 1): [2]}, cp_size=2, "
        "pack_size=16)\n"
        "print(pack.layout().rank_indices(2, 1).tolist(), layout.rank_indices(np.array([8, 8]), 2, 0).tolist())\n"
        "print(sys.modules['torch'] is None, [m for m in sys.modules if m.startswith('torch.')])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[2, 3, 4, 5, 8, 9, 10, 15] [0, 1, 6, 7, 8, 9, 14, 15]", "True []"]
