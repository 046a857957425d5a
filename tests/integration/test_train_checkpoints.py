"""Checkpoints are never lost, and a damaged one is never trained on (issue 9, items 1 and 2).

Most runs are the real trainer in this process (one rank, gloo), configured by Hydra from the
same overrides as ``test_train.py`` (a tiny model, 256-token packs, 60 stdlib files), a
checkpoint every step. The real entry point runs too: ``torchrun`` with 2 ranks (cp 2), so that
the checksums are written and verified by both ranks, and ``python -m thdpack.train`` for the
exit code of a run that finds no valid checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from test_train import REPO, TINY, losses, torchrun

from thdpack.train.checkpoint import verify_checkpoint
from thdpack.train.trainer import run

pytestmark = pytest.mark.distributed
RUN = ["parallel.cp_size=1", "train.steps=4", "train.checkpoint_every=1"]
"""Four steps, a checkpoint after each (two kept)."""


def config(out: Path, cache: Path, *overrides: str):
    """The ``thdpack.train.config.Config`` that ``python -m thdpack.train`` builds from these overrides."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from thdpack.train.__main__ import CONFIG_DIR
    from thdpack.train.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("train", [*TINY, f"data.cache_dir={cache}", f"train.output_dir={out}", *overrides])
    return OmegaConf.to_object(cfg)


def train(out: Path, cache: Path, *overrides: str) -> None:
    run(config(out, cache, *RUN, *overrides))


def entry(out: Path, cache: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``python -m thdpack.train`` (one process, no torchrun) with the overrides of ``train``."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "thdpack.train", *TINY, f"data.cache_dir={cache}", f"train.output_dir={out}"]
    return subprocess.run([*cmd, *RUN, *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def copy_run(run: Path, tmp_path: Path) -> Path:
    """A copy of a module's run (its output_dir) for one test to change."""
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def folders(checkpoints: Path) -> list[str]:
    return sorted(p.name for p in checkpoints.iterdir())


def overwrite_middle(file: Path) -> None:
    """4 KiB of random bytes in the middle of ``file``: same size, different content."""
    with file.open("r+b") as f:
        f.seek(file.stat().st_size // 2)
        f.write(os.urandom(4096))


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache) -> list[float]:
    """The losses of RUN, uninterrupted."""
    out = tmp_path_factory.mktemp("straight")
    train(out, cache)
    return losses(out)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, cache) -> Path:
    """RUN stopped after step 3: it keeps step_000002 and step_000003."""
    out = tmp_path_factory.mktemp("stopped")
    train(out, cache, "train.stop_at=3")
    assert folders(out / "checkpoints") == ["latest", "step_000002", "step_000003"]
    return out


@pytest.fixture
def stopped_copy(stopped, tmp_path) -> Path:
    return copy_run(stopped, tmp_path)


def test_fresh_run_into_a_used_output_dir_is_refused_or_overwritten(tmp_path, cache, caplog, capsys):
    checkpoints = tmp_path / "checkpoints"
    train(tmp_path, cache, "train.steps=3")
    three_steps = losses(tmp_path)
    assert folders(checkpoints) == ["latest", "step_000002", "step_000003"]
    refusal = (
        f"{checkpoints} holds the checkpoints of an earlier run (latest, step_000002, step_000003); continue it "
        "with train.resume=true, write to a new train.output_dir, or delete them with train.overwrite=true"
    )
    with pytest.raises(ValueError, match=re.escape(refusal)):
        train(tmp_path, cache, "train.steps=3", "train.stop_at=1")
    assert folders(checkpoints) == ["latest", "step_000002", "step_000003"]
    assert losses(tmp_path) == three_steps  # metrics.jsonl untouched

    # the reported case: pruning deleted the step_000001 just saved and `latest` named it
    with caplog.at_level(logging.WARNING, logger="thdpack.train.resume"):
        train(tmp_path, cache, "train.steps=3", "train.stop_at=1", "train.overwrite=true")
    assert f"train.overwrite=true: deleting {checkpoints} (latest, step_000002, step_000003)" in caplog.text
    assert folders(checkpoints) == ["latest", "step_000001"]
    assert (checkpoints / "latest").read_text() == "step_000001"
    assert verify_checkpoint(checkpoints / "step_000001") == []

    capsys.readouterr()
    train(tmp_path, cache, "train.steps=3", "train.resume=true")
    assert f"resumed from {checkpoints / 'step_000001'} (step 1)" in capsys.readouterr().out
    assert losses(tmp_path) == three_steps


def test_resume_and_overwrite_together_are_refused():
    from thdpack.train.config import TrainConfig

    with pytest.raises(ValueError, match=re.escape("train.resume=true and train.overwrite=true contradict each other")):
        TrainConfig(resume=True, overwrite=True)


Damage = Callable[[Path], tuple[str, str]]
"""Damages a checkpoint folder; returns (the damaged file relative to it, what resume says of it)."""


def _random_bytes_in_shard(folder: Path) -> tuple[str, str]:
    overwrite_middle(folder / "dcp" / "__0_0.distcp")
    return "dcp/__0_0.distcp", "does not match its sha256 in checksums.json"


def _truncated_shard(folder: Path) -> tuple[str, str]:
    size = (folder / "dcp" / "__0_0.distcp").stat().st_size
    truncate(folder / "dcp" / "__0_0.distcp")
    return "dcp/__0_0.distcp", f"has {size // 2} bytes, checksums.json says {size}"


def _truncated_metadata(folder: Path) -> tuple[str, str]:
    size = (folder / "dcp" / ".metadata").stat().st_size
    truncate(folder / "dcp" / ".metadata")
    return "dcp/.metadata", f"has {size // 2} bytes, checksums.json says {size}"


def _deleted_trainer_state(folder: Path) -> tuple[str, str]:
    (folder / "trainer.pt").unlink()
    return "trainer.pt", "is missing"


def _unfinished_save(folder: Path) -> tuple[str, str]:
    (folder / "checksums.json").unlink()  # killed after the files, before the manifest
    return "checksums.json", "is missing (a save that did not finish)"


def _manifest_cut_mid_json(folder: Path) -> tuple[str, str]:
    truncate(folder / "checksums.json")
    return "checksums.json", "is unreadable"


DAMAGES: dict[str, Damage] = {
    "random-bytes-in-shard": _random_bytes_in_shard,
    "truncated-shard": _truncated_shard,
    "truncated-metadata": _truncated_metadata,
    "deleted-trainer-state": _deleted_trainer_state,
    "unfinished-save": _unfinished_save,
    "manifest-cut": _manifest_cut_mid_json,
}


@pytest.mark.parametrize("damage", DAMAGES.values(), ids=DAMAGES.keys())
def test_resume_falls_back_past_a_damaged_checkpoint(stopped_copy, cache, straight, damage, caplog, capsys):
    checkpoints = stopped_copy / "checkpoints"
    file, says = damage(checkpoints / "step_000003")
    problem = f"{checkpoints / 'step_000003' / file} {says}"
    assert verify_checkpoint(checkpoints / "step_000003")[0].startswith(problem)
    with caplog.at_level(logging.WARNING, logger="thdpack.train.resume"):
        train(stopped_copy, cache, "train.resume=true")
    assert f"skipping checkpoint step_000003: {problem}" in caplog.text
    assert f"moved step_000003 to {checkpoints / 'damaged'} (inspect, then delete)" in caplog.text
    assert f"resumed from {checkpoints / 'step_000002'} (step 2)" in capsys.readouterr().out
    assert losses(stopped_copy) == straight
    # step 3 trained again and saved again; pruning kept it and step 4, the damaged one set aside
    assert folders(checkpoints) == ["damaged", "latest", "step_000003", "step_000004"]
    assert (checkpoints / "latest").read_text() == "step_000004"
    assert verify_checkpoint(checkpoints / "step_000003") == verify_checkpoint(checkpoints / "step_000004") == []
    assert verify_checkpoint(checkpoints / "damaged" / "step_000003")[0].startswith(
        f"{checkpoints / 'damaged' / 'step_000003' / file} {says}"
    )


def test_empty_latest_resumes_from_the_newest_valid_checkpoint(stopped_copy, cache, straight, caplog, capsys):
    checkpoints = stopped_copy / "checkpoints"
    (checkpoints / "latest").write_text("")
    with caplog.at_level(logging.WARNING, logger="thdpack.train.resume"):
        train(stopped_copy, cache, "train.resume=true")
    assert f"{checkpoints / 'latest'} named ''; it now names step_000003" in caplog.text
    assert f"resumed from {checkpoints / 'step_000003'} (step 3)" in capsys.readouterr().out
    assert losses(stopped_copy) == straight
    assert (checkpoints / "latest").read_text() == "step_000004"


def test_no_valid_checkpoint_names_every_damaged_file(stopped_copy, cache):
    checkpoints = stopped_copy / "checkpoints"
    overwrite_middle(checkpoints / "step_000003" / "dcp" / "__0_0.distcp")
    (checkpoints / "step_000002" / "trainer.pt").unlink()
    message = (
        f"no valid checkpoint in {checkpoints}: "
        f"{checkpoints / 'step_000003' / 'dcp' / '__0_0.distcp'} does not match its sha256 in checksums.json; "
        f"{checkpoints / 'step_000002' / 'trainer.pt'} is missing; restore the files, "
        "or start over with train.overwrite=true or a new train.output_dir"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        train(stopped_copy, cache, "train.resume=true")
    result = entry(stopped_copy, cache, "train.resume=true")
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"thdpack.train: error: {message}" in result.stderr
    assert folders(checkpoints) == ["latest", "step_000002", "step_000003"]  # nothing moved or deleted


def test_verify_checkpoint_names_each_damaged_file(stopped_copy):
    folder = stopped_copy / "checkpoints" / "step_000003"
    assert verify_checkpoint(folder) == []
    rng = folder / "rng" / "rank_0.pt"
    size = rng.stat().st_size
    overwrite_middle(folder / "dcp" / "__0_0.distcp")
    truncate(rng)
    (folder / "trainer.pt").unlink()
    assert verify_checkpoint(folder) == [
        f"{folder / 'dcp' / '__0_0.distcp'} does not match its sha256 in checksums.json",
        f"{rng} has {size // 2} bytes, checksums.json says {size}",
        f"{folder / 'trainer.pt'} is missing",
    ]


def test_torchrun_resumes_past_a_damaged_shard(tmp_path, cache):
    """2 ranks (cp 2): both hash a share of the files on save and on resume, and agree."""
    checkpoints = tmp_path / "checkpoints"
    torchrun(tmp_path, cache, "train.steps=3", "train.checkpoint_every=1")
    uninterrupted = losses(tmp_path)
    shards = sorted((checkpoints / "step_000003" / "dcp").glob("*.distcp"), key=lambda p: p.stat().st_size)
    overwrite_middle(shards[-1])
    result = torchrun(tmp_path, cache, "train.steps=3", "train.checkpoint_every=1", "train.resume=true")
    assert f"skipping checkpoint step_000003: {shards[-1]} does not match its sha256" in result.stderr
    assert f"resumed from {checkpoints / 'step_000002'} (step 2)" in result.stdout
    assert losses(tmp_path) == uninterrupted
    assert verify_checkpoint(checkpoints / "step_000003") == []


def test_a_refused_fresh_run_leaves_the_earlier_config(stopped_copy, cache):
    """The real entry: a fresh run into a used output_dir exits 2 and keeps the earlier config.yaml."""
    (stopped_copy / "config.yaml").write_text("the earlier run's config\n")
    result = entry(stopped_copy, cache, "train.steps=7")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "holds the checkpoints of an earlier run" in result.stderr
    assert (stopped_copy / "config.yaml").read_text() == "the earlier run's config\n"


class RunsCode:
    """Unpickles by calling ``os.system``: touches ``marker`` (the attack a crafted checkpoint file carries)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _craft(folder: Path, name: str, payload: RunsCode) -> None:
    """Put ``payload`` into the checkpoint file ``name`` and recompute its checksum, as an attacker would."""
    import json
    import pickle

    import torch

    from thdpack.files.publish import file_digest

    file = folder / name
    if name == "dcp/.metadata":
        file.write_bytes(pickle.dumps(payload))
    else:
        torch.save({**torch.load(file, weights_only=True), "payload": payload}, file)
    manifest = json.loads((folder / "checksums.json").read_text())
    manifest["files"][name] = file_digest(file)
    (folder / "checksums.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["trainer.pt", "rng/rank_0.pt", "dcp/.metadata"])
def test_a_crafted_checkpoint_file_is_refused_without_running_it(stopped_copy, cache, tmp_path, name):
    folder = stopped_copy / "checkpoints" / "step_000003"
    marker = tmp_path / "payload_ran"
    _craft(folder, name, RunsCode(marker))
    assert verify_checkpoint(folder) == []  # the checksums cannot tell
    refusal = (
        f"{folder / name} is refused: it asks for the global posix.system, and thdpack loads only tensors and plain "
        "values, never code, from a file"
    )
    with pytest.raises(ValueError, match=re.escape(refusal)):
        train(stopped_copy, cache, "train.resume=true")
    assert not marker.exists()
