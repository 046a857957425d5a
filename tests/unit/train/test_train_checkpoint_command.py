"""``thdpack checkpoint info``: the record of a checkpoint's data stream, its digest recomputed."""

from __future__ import annotations

import numpy as np

from thdpack.cli import main
from thdpack.files.state_file import write_state
from thdpack.integrations.stream_state import write_stream_state
from thdpack.packing import PackedDataset

LENGTHS = [5, 9, 3, 14, 7, 2, 11, 6]
SAMPLES = [{"input_ids": list(range(1, n + 1))} for n in LENGTHS]


def _state(steps: int) -> dict:
    stream = PackedDataset(SAMPLES, 16, lengths=LENGTHS, seed=0).step_stream(micro_batches=1, packs_per_micro_batch=1)
    for _ in range(steps):
        stream.next_step()
    return stream.state_dict()


def test_info_prints_what_was_consumed_and_the_recomputed_digest(tmp_path, capsys):
    state = _state(2)
    folder = tmp_path / "checkpoints" / "step_000002"
    folder.mkdir(parents=True)
    write_state(folder / "stream.json", state)
    (tmp_path / "checkpoints" / "latest").write_text("step_000002")
    assert main(["checkpoint", "info", str(tmp_path), "--pieces"]) == 0
    out = capsys.readouterr().out
    consumed = state["consumed"]
    assert f"checkpoint {folder}" in out and f"data: 8 sequences, {sum(LENGTHS)} tokens" in out
    assert f"epoch 0: 2 of {state['plan_packs']} packs of its plan" in out
    assert f"consumed: {consumed['sequences_whole']} sequences whole, 0 in part, {consumed['tokens']} tokens" in out
    assert f"consumed sha256: {consumed['sha256']} (recomputed from the arrays: matches the record)" in out
    whole = np.flatnonzero(np.unpackbits(state["arrays"]["consumed.whole"]))
    assert out.strip().splitlines()[-len(whole) :] == [str(s) for s in whole]  # --pieces


def test_info_reads_a_trainer_integration_checkpoint(tmp_path, capsys):
    state = _state(1)
    arrays = state.pop("arrays")
    (tmp_path / "checkpoint-1").mkdir()
    write_stream_state(tmp_path / "checkpoint-1", {"steps_done": 1, "stream": state, "arrays": arrays})
    assert main(["checkpoint", "info", str(tmp_path)]) == 0
    assert f"checkpoint {tmp_path / 'checkpoint-1'} (step 1)" in capsys.readouterr().out


def test_a_folder_without_a_checkpoint_is_named(tmp_path, capsys):
    assert main(["checkpoint", "info", str(tmp_path)]) == 2
    assert (
        f"thdpack checkpoint: error: {tmp_path} holds no checkpoint with a data stream record"
        in capsys.readouterr().err
    )
