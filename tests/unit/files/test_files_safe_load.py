"""Nothing thdpack loads runs code: a crafted pickle is refused by name, and its payload never runs.

Each payload touches a marker file when unpickled; the tests check the marker stays absent.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from thdpack.files.safe_dcp import load_dcp
from thdpack.files.safe_load import UnsafeFileError, load_plain


class RunsCode:
    """Unpickles by calling ``os.system``, which touches ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def refusal(path: Path, asked: str = "the global posix.system") -> str:
    return re.escape(f"{path} is refused: it asks for {asked}, and thdpack loads only tensors and plain values")


def save_dcp(state: dict, folder: Path) -> None:
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=folder)


def load_dcp_quietly(state: dict, folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        load_dcp(state, folder)


def test_load_plain_reads_tensors_and_plain_values(tmp_path):
    state = {"step": 3, "lrs": [0.1, 0.2], "pair": (1, "a"), "none": None, "t": torch.arange(3)}
    torch.save(state, tmp_path / "state.pt")
    loaded = load_plain(tmp_path / "state.pt")
    assert loaded["t"].tolist() == [0, 1, 2]
    assert {k: v for k, v in loaded.items() if k != "t"} == {k: v for k, v in state.items() if k != "t"}


def test_load_plain_refuses_a_payload_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"step": 3, "x": RunsCode(marker)}, tmp_path / "state.pt")
    with pytest.raises(UnsafeFileError, match=refusal(tmp_path / "state.pt")):
        load_plain(tmp_path / "state.pt")
    assert not marker.exists()


def test_load_plain_refuses_numpy_objects(tmp_path):
    import numpy as np

    torch.save({"key": np.arange(3)}, tmp_path / "old.pt")
    with pytest.raises(UnsafeFileError, match=r"old\.pt is refused: it asks for the global numpy\."):
        load_plain(tmp_path / "old.pt")


def test_load_dcp_round_trips_tensors_and_plain_values(tmp_path):
    save_dcp({"w": torch.arange(4.0), "lr": 0.5, "betas": (0.9, 0.99), "fused": None}, tmp_path / "dcp")
    state = {"w": torch.zeros(4), "lr": 0.0, "betas": None, "fused": True}
    load_dcp_quietly(state, tmp_path / "dcp")
    assert state["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert (state["lr"], state["betas"], state["fused"]) == (0.5, (0.9, 0.99), None)


def test_load_dcp_refuses_a_payload_among_the_values(tmp_path):
    marker = tmp_path / "ran"
    save_dcp({"w": torch.arange(4.0), "lr": RunsCode(marker)}, tmp_path / "dcp")
    with pytest.raises(UnsafeFileError, match=refusal(tmp_path / "dcp", "the global posix.system in the value 'lr'")):
        load_dcp_quietly({"w": torch.zeros(4), "lr": 0.0}, tmp_path / "dcp")
    assert not marker.exists()


def test_load_dcp_refuses_a_payload_as_metadata(tmp_path):
    marker = tmp_path / "ran"
    save_dcp({"w": torch.arange(4.0)}, tmp_path / "dcp")
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(UnsafeFileError, match=refusal(tmp_path / "dcp" / ".metadata")):
        load_dcp_quietly({"w": torch.zeros(4)}, tmp_path / "dcp")
    assert not marker.exists()


def test_load_dcp_refuses_metadata_of_another_type(tmp_path):
    save_dcp({"w": torch.arange(4.0)}, tmp_path / "dcp")
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(
        UnsafeFileError, match=refusal(tmp_path / "dcp" / ".metadata", "a dict where a checkpoint's Metadata belongs")
    ):
        load_dcp_quietly({"w": torch.zeros(4)}, tmp_path / "dcp")
