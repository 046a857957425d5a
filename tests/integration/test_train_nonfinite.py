"""A run stops at the first non-finite gradient or parameter, and never saves it (issue 17, item 4).

Before: ``train.lr=inf`` was accepted and wrote a checkpoint of non-finite weights, exit code 0;
only a non-finite loss stopped the run, so a NaN gradient (the loss of its step still finite)
was applied and saved. The faults are planted in the real trainer (one rank, in this process):
a NaN in a gradient before the clip, an infinity in a weight after the optimizer step.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from short_records import write_short_store
from test_train_checkpoints import config, folders

import thdpack.train.trainer as trainer
from thdpack.train.checkpoint import verify_checkpoint
from thdpack.train.trainer import run

pytestmark = pytest.mark.distributed
RUN = ["parallel.cp_size=1", "train.steps=3", "train.checkpoint_every=1"]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return write_short_store(tmp_path_factory.mktemp("stores") / "S", seed=0)


def train(out: Path, store: Path) -> None:
    run(config(out, out / "unused-cache", *RUN, f"data.store={store}"))


def at_step(n: int):
    """A predicate true on the n-th call (the n-th optimizer step)."""
    calls = {"count": 0}

    def now() -> bool:
        calls["count"] += 1
        return calls["count"] == n

    return now


def assert_stopped_before_saving_step_2(out: Path) -> None:
    checkpoints = out / "checkpoints"
    assert folders(checkpoints) == ["latest", "step_000001"]
    assert (checkpoints / "latest").read_text() == "step_000001" and verify_checkpoint(
        checkpoints / "step_000001"
    ) == []


def test_a_nan_gradient_stops_the_run_before_the_step_is_saved(tmp_path, store, monkeypatch):
    clip, second = trainer.clip_grad_norm, at_step(2)

    def nan_gradient(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        if second():
            next(model.parameters()).grad[0] = float("nan")
        return clip(model, max_norm)

    monkeypatch.setattr(trainer, "clip_grad_norm", nan_gradient)
    said = (
        r"step 2: the loss is \d+\.\d{4} but the gradient norm is nan \(a gradient holds NaN or infinity\); lower "
        "train.lr or check the data. The run stops without saving this step "
        + re.escape(f"(the last checkpoint is {tmp_path / 'checkpoints' / 'step_000001'})")
    )
    with pytest.raises(FloatingPointError, match=said):
        train(tmp_path, store)
    assert_stopped_before_saving_step_2(tmp_path)


def test_a_non_finite_weight_after_the_update_stops_the_run(tmp_path, store, monkeypatch):
    step, second = torch.optim.AdamW.step, at_step(2)

    def infinite_weight(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        if second():
            with torch.no_grad():
                self.param_groups[1]["params"][0][0] = float("inf")  # the first norm's gain
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", infinite_weight)
    said = "step 2: after the optimizer step, parameters hold NaN or infinity (layers.0.input_layernorm.weight)"
    with pytest.raises(FloatingPointError, match=re.escape(said)):
        train(tmp_path, store)
    assert_stopped_before_saving_step_2(tmp_path)
