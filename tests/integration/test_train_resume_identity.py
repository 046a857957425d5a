"""Resume continues the run it claims to (issue 17, item 1 and the resume errors).

A checkpoint records what it was trained on and with: its data (the store's checksums), its
tokenizer and its model settings. Before: a resume on another store of the same size printed
"resumed from ... step_000002" and trained on it without a word; ``model.dim`` changed gave
torch's "CheckpointException ... Size mismatch", ``model=hf`` "Missing key"; a checkpoint already
at ``train.steps`` printed "resumed" and trained nothing, silently.

The runs are the real trainer in this process (one rank, gloo), with issue 17's store: 300 short
records (``short_records.py``), and the overrides of ``test_train.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from short_records import write_short_store
from test_train import losses
from test_train_checkpoints import config, copy_run, folders

from thdpack.train.trainer import run

pytestmark = pytest.mark.distributed
RUN = ["parallel.cp_size=1", "train.steps=3", "train.checkpoint_every=1"]


def train(out: Path, store: Path, *overrides: str) -> None:
    run(config(out, out / "unused-cache", *RUN, f"data.store={store}", *overrides))


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> tuple[Path, Path]:
    """Two stores of 300 records each, with different records."""
    folder = tmp_path_factory.mktemp("stores")
    return write_short_store(folder / "S", seed=0), write_short_store(folder / "S_alt", seed=1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, stores) -> Path:
    """2 of 3 steps on S, a checkpoint after each."""
    out = tmp_path_factory.mktemp("trained")
    train(out, stores[0], "train.stop_at=2")
    return out


@pytest.fixture
def out(trained, tmp_path) -> Path:
    return copy_run(trained, tmp_path)


def test_resume_on_other_data_is_refused_naming_the_files(out, stores):
    store, other = stores
    checkpoint = out / "checkpoints" / "step_000002"
    digests = r"sha256 [0-9a-f]{12}\.\.\. \(checkpoint\), [0-9a-f]{12}\.\.\. \(this run\)"
    message = (
        re.escape(f"checkpoint {checkpoint} was trained on other data than this run's: data (offsets.npy: ")
        + digests
        + "; tokens.bin: "
        + digests
        + re.escape(
            f"); it was trained on data.store={store}, this run reads data.store={other}. Resume with the data it "
            "was trained on, or set train.resume_data_changed=true"
        )
    )
    with pytest.raises(ValueError, match=message):
        train(out, other, "train.resume=true")
    assert len(losses(out)) == 2 and folders(out / "checkpoints") == ["latest", "step_000001", "step_000002"]


def test_resume_data_changed_continues_the_model_on_the_new_data(out, stores, capsys):
    train(out, stores[1], "train.resume=true", "train.resume_data_changed=true")
    said = capsys.readouterr().out
    assert f"resumed from {out / 'checkpoints' / 'step_000002'} (step 2) on other data" in said
    assert "the data stream starts at this data's beginning" in said
    assert len(losses(out)) == 3
    identity = torch.load(out / "checkpoints" / "step_000003" / "trainer.pt", weights_only=False)["identity"]
    assert identity["data"]["origin"] == f"data.store={stores[1]}"


def test_resume_with_another_model_is_refused_before_loading_it(out, stores):
    checkpoint = out / "checkpoints" / "step_000002"
    settings = "the model settings that made it (its config.yaml in train.output_dir), or start a new train.output_dir"
    with pytest.raises(ValueError, match=re.escape(f"(dim: checkpoint 32, this run 64); resume with {settings}")):
        train(out, stores[0], "train.resume=true", "model.dim=64")
    refusal = f"checkpoint {checkpoint} holds another model than this run's (kind: checkpoint 'thdpack', this run 'hf')"
    with pytest.raises(ValueError, match=re.escape(refusal)):
        train(out, stores[0], "train.resume=true", "model=hf")


def test_resume_at_the_end_trains_nothing_and_past_it_is_refused(out, stores, capsys):
    checkpoint = out / "checkpoints" / "step_000002"
    before = (checkpoint / "checksums.json").read_text()
    assert run(config(out, out, *RUN, f"data.store={stores[0]}", "train.resume=true", "train.steps=2")) == []
    said = capsys.readouterr().out
    assert (
        f"checkpoint {checkpoint} is at step 2, and this run ends at step 2 (train.steps=2): nothing left to train; "
        "raise train.steps to train on"
    ) in said
    assert "saved checkpoint" not in said and (checkpoint / "checksums.json").read_text() == before
    past = f"checkpoint {checkpoint} is at step 2, past train.steps=1; set train.steps above 2 to train on from it"
    with pytest.raises(ValueError, match=re.escape(past)):
        run(config(out, out, *RUN, f"data.store={stores[0]}", "train.resume=true", "train.steps=1"))
