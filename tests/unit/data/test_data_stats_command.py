"""`thdpack stats` on token stores (verified in full first) and on empty lengths files (issue 9, items 3 and 5)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_data_store_verify import make_store, overwrite, save_offsets, set_at

from thdpack.cli import main
from thdpack.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


def test_an_intact_store_is_verified_then_planned(tmp_path, gpt2, capsys):
    store = make_store(tmp_path / "store", gpt2)
    assert main(["stats", str(store), "--pack-size", "64", "--algorithm", "bfd"]) == 0
    out = capsys.readouterr().out
    assert f"verified {store}: sha256, offsets and token ids of 20 samples, 250 tokens (all < 50,257)" in out
    assert "20 sequences, 230 tokens" in out  # labels format: each sample trains on n - 1 tokens


# the reproductions: each passed `thdpack stats` with exit code 0
DAMAGE = {
    "ids above the vocabulary": (
        lambda s: overwrite(s / "tokens.bin", "uint16", set_at(5, 60000)),
        "tokens.bin holds token id 60000 at token 5 (sample 1), outside [0, 50257) of tokenizer 'gpt2'",
    ),
    "a loss-mask byte changed": (
        lambda s: overwrite(s / "loss_mask.bin", "uint8", set_at(40, 0)),
        "loss_mask.bin does not match its sha256 in manifest.json",
    ),
    "a shifted offset": (
        lambda s: save_offsets(s, set_at(4, 19)),
        "offsets.npy does not match its sha256 in manifest.json",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_store_exits_non_zero_naming_the_file(tmp_path, gpt2, capsys, case):
    damage, message = DAMAGE[case]
    store = make_store(tmp_path / "store", gpt2)
    damage(store)
    assert main(["stats", str(store), "--pack-size", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"thdpack stats: error: {store}/{message}")
    assert f"write it again with `thdpack prepare ... --out {store} --overwrite`" in err


def test_empty_lengths_are_a_message(tmp_path, capsys):
    np.save(tmp_path / "empty.npy", np.zeros(0, dtype=np.int64))  # numpy's "zero-size array" error before
    (tmp_path / "empty.txt").write_text("")
    for name in ("empty.npy", "empty.txt"):
        assert main(["stats", str(tmp_path / name)]) == 2
        expected = f"thdpack stats: error: {tmp_path / name} holds no lengths (0 sequences); give a file with one"
        assert capsys.readouterr().err.startswith(expected)
    np.save(tmp_path / "zeros.npy", np.zeros(3, dtype=np.int64))
    assert main(["stats", str(tmp_path / "zeros.npy")]) == 2
    assert f"{tmp_path / 'zeros.npy'}: all 3 sequences are empty; there is nothing to pack" in capsys.readouterr().err
    np.save(tmp_path / "grid.npy", np.ones((2, 3), dtype=np.int64))
    assert main(["stats", str(tmp_path / "grid.npy")]) == 2
    message = f"{tmp_path / 'grid.npy'} holds int64 of shape (2, 3); expected 1-D integer lengths"
    assert re.search(re.escape(message), capsys.readouterr().err)


def test_a_lengths_file_of_objects_is_named_and_never_unpickled(tmp_path, capsys):
    np.save(tmp_path / "objects.npy", np.array([3, "four", None], dtype=object), allow_pickle=True)
    (tmp_path / "text.npy").write_text("3\n4\n")  # numpy takes it for a pickle
    for name, holds in (("objects.npy", "Python objects (an object array)"), ("text.npy", "no .npy array")):
        assert main(["stats", str(tmp_path / name)]) == 2
        expected = f"thdpack stats: error: {tmp_path / name} holds {holds}, and thdpack never unpickles a file; save"
        assert capsys.readouterr().err.startswith(expected)


def test_a_negative_length_is_named_with_its_sequence(tmp_path, capsys):
    (tmp_path / "lengths.txt").write_text("4\n0\n-7\n9\n")
    assert main(["stats", str(tmp_path / "lengths.txt")]) == 2
    expected = f"thdpack stats: error: {tmp_path / 'lengths.txt'}: sequence 2 has length -7 (1 negative in all)"
    assert capsys.readouterr().err.startswith(expected)
