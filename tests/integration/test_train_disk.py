"""A full disk and a read-only output_dir end in a message naming the path and the fix (issue 17,
unclear errors).

Before: a checkpoint on a full disk failed with "RuntimeError: [enforce fail at
inline_container.cc:672] unexpected pos", ``thdpack prepare`` with "[Errno 28] No space left on
device" (no path), and a read-only ``train.output_dir`` with a Hydra traceback.

The file systems are real: tmpfs mounts (a read-only one, a 1 MiB one, a 16 KiB one) in a user
and mount namespace (``unshare -rm``), where the commands run as they would for a user.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from short_records import T, write_short_store
from test_train import REPO

pytestmark = pytest.mark.distributed


def can_mount(tmp_path: Path) -> str | None:
    """Why tmpfs cannot be mounted here (None: it can)."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = tmp_path / "probe"
    probe.mkdir()
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=16k none {probe}"], capture_output=True, text=True
    )
    return None if result.returncode == 0 else f"cannot mount tmpfs in a user namespace: {result.stderr.strip()}"


def test_a_read_only_or_full_disk_is_named_with_the_fix(tmp_path):
    why = can_mount(tmp_path)
    if why is not None:
        pytest.skip(why)
    store = write_short_store(tmp_path / "S", seed=0)
    read_only, full, tiny, logs = (tmp_path / name for name in ("read_only", "full", "tiny", "logs"))
    for folder in (read_only, full, tiny, logs):
        folder.mkdir()
    train = [sys.executable, "-m", "thdpack.train", *T, f"data.store={store}", "parallel.cp_size=1", "train.steps=1"]
    prepare = [sys.executable, "-c", "import sys; from thdpack.cli import main; sys.exit(main())", "prepare"]
    prepare += [str(tmp_path / "S.jsonl"), "--tokenizer", "gpt2", "--pack-size", "256", "--no-plots"]
    commands = {
        "read_only": [*train, f"train.output_dir={read_only}/run"],
        "full": [*train, f"train.output_dir={full}/run"],
        "prepare": [*prepare, "--out", f"{tiny}/store"],
    }
    script = [
        f"mount -t tmpfs -o ro,size=64k none {read_only}",
        f"mount -t tmpfs -o size=1m none {full}",
        f"mount -t tmpfs -o size=16k none {tiny}",
        *(
            f"{shlex.join(cmd)} >{logs}/{name}.out 2>{logs}/{name}.err; echo $? >{logs}/{name}.rc"
            for name, cmd in commands.items()
        ),
    ]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    subprocess.run(["unshare", "-rm", "sh", "-c", "\n".join(script)], cwd=REPO, env=env, check=True, timeout=600)

    def result(name: str) -> tuple[int, str]:
        return int((logs / f"{name}.rc").read_text()), (logs / f"{name}.err").read_text()

    code, said = result("read_only")
    assert code == 2 and "Traceback" not in said, said[-3000:]
    assert (
        f"thdpack.train: error: train.output_dir={read_only}/run cannot be written (Read-only file system: "
        f"{read_only}/run); choose a folder this process can write"
    ) in said

    code, said = result("full")
    checkpoint = f"{full}/run/checkpoints/step_000001"
    assert code == 1 and "Traceback" not in said, said[-3000:]
    assert (
        f"thdpack.train: error: could not save checkpoint {checkpoint}: the disk that holds {full}/run/checkpoints "
        "ran out of space (0 bytes free now) (RuntimeError: "
    ) in said
    assert "free space there, or set train.output_dir to a larger disk, then continue" in said

    code, said = result("prepare")
    assert code == 2, said[-3000:]
    assert f"thdpack prepare: error: the disk that holds {tiny}/store ran out of space (" in said
    assert "[Errno 28] No space left on device); free space there or choose another --out, then run again" in said
