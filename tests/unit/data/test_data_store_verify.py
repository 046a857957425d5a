"""A damaged token store is never trained on (issue 9, items 3 and 5).

Checksums recorded while writing, ``verify_store`` reading every byte, and the cheap checks at
open: each kind of damage is a ``StoreError`` naming the file, what is wrong and what to do.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from thdpack.data import StoreBusyError, StoreError, StoreVerification, verify_store
from thdpack.data.encode import TokenizedSample
from thdpack.data.store import TokenStore, TokenStoreWriter, read_manifest
from thdpack.data.tokenizer import load_tokenizer
from thdpack.files.lock import FolderLock
from thdpack.files.publish import file_digest


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


def make_store(path: Path, gpt2) -> Path:
    """20 SFT-like samples (3..22 tokens, the first two of each masked): all three data files."""
    rng = np.random.default_rng(0)
    with TokenStoreWriter(path, tokenizer=gpt2, source={"format": "test"}) as writer:
        for n in range(3, 23):
            mask = np.ones(n, bool)
            mask[:2] = False
            writer.add(TokenizedSample(rng.integers(0, 50000, n), mask))
    return path


@pytest.fixture
def store(tmp_path, gpt2) -> Path:
    return make_store(tmp_path / "store", gpt2)


def rewrite_fix(folder: Path) -> str:
    return f"; the store is damaged: write it again with `thdpack prepare ... --out {folder} --overwrite`"


def test_checksums_and_id_range_are_recorded_while_writing(store):
    manifest = read_manifest(store)
    assert manifest["version"] == 2
    assert set(manifest["checksums"]) == {"tokens.bin", "offsets.npy", "loss_mask.bin"}
    for name, recorded in manifest["checksums"].items():
        assert recorded == file_digest(store / name)  # the streamed hash equals a re-read
    tokens = np.fromfile(store / "tokens.bin", dtype=np.uint16)
    assert manifest["token_ids"] == {"min": int(tokens.min()), "max": int(tokens.max())}
    result = verify_store(store)
    assert isinstance(result, StoreVerification) and result.checksums and result.id_limit == 50257
    assert result.bytes_read == sum((store / n).stat().st_size for n in manifest["checksums"])
    assert str(result).startswith(f"verified {store}: sha256, offsets and token ids of 20 samples, 250 tokens")


def test_an_empty_store_verifies(tmp_path, gpt2):
    with TokenStoreWriter(tmp_path, tokenizer=gpt2):
        pass
    assert read_manifest(tmp_path)["token_ids"] == {"min": None, "max": None}
    assert verify_store(tmp_path).num_tokens == 0 and len(TokenStore(tmp_path)) == 0


def overwrite(file: Path, dtype: str, edit: Callable[[np.ndarray], None]) -> None:
    """Edit ``file`` in place: same size, other content."""
    values = np.fromfile(file, dtype=dtype)
    edit(values)
    values.tofile(file)


def save_offsets(store: Path, edit: Callable[[np.ndarray], None]) -> None:
    offsets = np.load(store / "offsets.npy")
    edit(offsets)
    np.save(store / "offsets.npy", offsets)


def edit_manifest(store: Path, edit: Callable[[dict], None]) -> None:
    manifest = json.loads((store / "manifest.json").read_text())
    edit(manifest)
    (store / "manifest.json").write_text(json.dumps(manifest))


def shuffle(values: np.ndarray) -> None:
    values[:] = np.random.default_rng(1).permutation(values)


def set_at(index: int, value: int) -> Callable[[np.ndarray], None]:
    def edit(values: np.ndarray) -> None:
        values[index] = value

    return edit


# damage, the file it names, what verify_store says of it; every one passed `thdpack stats` (exit 0) before
CONTENT_DAMAGE = {
    "ids above the vocabulary": (
        lambda s: overwrite(s / "tokens.bin", "uint16", set_at(5, 60000)),
        "tokens.bin",
        "holds token id 60000 at token 5 (sample 1), outside [0, 50257) of tokenizer 'gpt2'",
    ),
    "shuffled tokens": (
        lambda s: overwrite(s / "tokens.bin", "uint16", shuffle),
        "tokens.bin",
        "does not match its sha256 in manifest.json (its content changed after the store was written)",
    ),
    "a loss-mask byte changed": (
        lambda s: overwrite(s / "loss_mask.bin", "uint8", set_at(40, 0)),
        "loss_mask.bin",
        "does not match its sha256 in manifest.json",
    ),
    "a loss-mask byte that is no flag": (
        lambda s: overwrite(s / "loss_mask.bin", "uint8", set_at(40, 7)),
        "loss_mask.bin",
        "holds 7 at byte 40; a mask byte is 0 or 1",
    ),
    "a shifted offset": (
        lambda s: save_offsets(s, set_at(4, 19)),  # 18 -> 19: still in order, samples 3 and 4 change
        "offsets.npy",
        "does not match its sha256 in manifest.json",
    ),
    "a changed id range": (
        lambda s: edit_manifest(s, lambda m: m["token_ids"].update(max=50000)),
        "manifest.json",
        "records token ids in [",
    ),
}


@pytest.mark.parametrize("case", list(CONTENT_DAMAGE))
def test_content_damage_is_found_by_verify_store(store, case):
    damage, name, problem = CONTENT_DAMAGE[case]
    TokenStore(store)  # intact sizes: the cheap checks at open pass ...
    damage(store)
    with pytest.raises(StoreError, match=re.escape(f"{store / name} {problem}")) as caught:
        verify_store(store)  # ... reading every byte does not
    assert caught.value.file == store / name and str(caught.value).endswith(rewrite_fix(store))


def truncate(file: Path, size: int) -> None:
    with file.open("r+b") as f:
        f.truncate(size)


# damage the cheap checks at open find too (TokenStore, and so `thdpack stats` and training)
STRUCTURE_DAMAGE = {
    "a truncated offsets.npy": (
        lambda s: truncate(s / "offsets.npy", 200),
        "offsets.npy",
        "has 200 bytes, its header implies 296 (cut short or replaced)",
    ),
    "a truncated tokens.bin": (
        lambda s: truncate(s / "tokens.bin", 100),
        "tokens.bin",
        "has 100 bytes, manifest.json implies 500 (cut short or replaced)",
    ),
    "a deleted loss_mask.bin": (lambda s: (s / "loss_mask.bin").unlink(), "loss_mask.bin", "is missing"),
    "an offset out of order": (
        lambda s: save_offsets(s, set_at(3, 2)),  # offsets[2] = 7: "sample 2 has length -5" before
        "offsets.npy",
        "is out of order at index 3: offsets[3]=2 < offsets[2]=7 (1 of 20 samples bad)",
    ),
    "a sample under 2 tokens": (
        lambda s: save_offsets(s, set_at(3, 8)),
        "offsets.npy",
        "gives sample 2 1 tokens (offsets[2]=7, offsets[3]=8); every sample has >= 2",
    ),
    "offsets that do not end at num_tokens": (
        lambda s: save_offsets(s, set_at(-1, 249)),
        "offsets.npy",
        "ends at 249; manifest.json says num_tokens=250",
    ),
    "a manifest cut mid-JSON": (
        lambda s: (s / "manifest.json").write_text((s / "manifest.json").read_text()[:300]),
        "manifest.json",
        "is not valid JSON (cut short or overwritten: ",
    ),
    "a manifest without num_tokens": (
        lambda s: edit_manifest(s, lambda m: m.pop("num_tokens")),
        "manifest.json",
        "has no 'num_tokens' field",
    ),
    "a manifest without checksums": (
        lambda s: edit_manifest(s, lambda m: m.pop("checksums")),
        "manifest.json",
        "has no 'checksums' field",
    ),
    "a manifest with a string count": (
        lambda s: edit_manifest(s, lambda m: m.update(num_samples="20")),
        "manifest.json",
        "has num_samples='20', not a JSON integer",
    ),
    "a manifest without the tokens' checksum": (
        lambda s: edit_manifest(s, lambda m: m["checksums"].pop("tokens.bin")),
        "manifest.json",
        "has checksums['tokens.bin']=None, not {'size': bytes, 'sha256': 64 hex digits}",
    ),
}


@pytest.mark.parametrize("case", list(STRUCTURE_DAMAGE))
def test_structure_damage_is_found_at_open_and_by_verify_store(store, case):
    damage, name, problem = STRUCTURE_DAMAGE[case]
    damage(store)
    message = re.escape(f"{store / name} {problem}")
    with pytest.raises(StoreError, match=message):
        TokenStore(store).lengths  # noqa: B018 (the lengths check the offsets' order)
    with pytest.raises(StoreError, match=message) as caught:
        verify_store(store)
    assert str(caught.value).endswith(rewrite_fix(store))


def test_ids_over_the_models_vocabulary_are_a_mismatch_not_damage(store):
    message = (
        f"{store / 'tokens.bin'} holds token id 42531 at token 0 (sample 0), outside the model's vocabulary "
        "(vocab_size=1000); the store was tokenized by 'gpt2' with 50257 ids: give the model vocab_size >= 50257"
    )
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        verify_store(store, vocab_size=1000)
    assert not isinstance(caught.value, StoreError)
    assert verify_store(store, vocab_size=60000).id_limit == 50257  # the tokenizer's bound is the tighter one


def make_legacy(store: Path) -> None:
    """The manifest as thdpack wrote it before checksums (store version 1)."""

    def to_v1(manifest: dict) -> None:
        del manifest["checksums"], manifest["token_ids"]
        manifest.update(version=1, created_by="thdpack 0.1.0")

    edit_manifest(store, to_v1)


def test_a_store_without_checksums_is_checked_for_structure_and_ids_with_a_warning(store, caplog):
    make_legacy(store)
    assert TokenStore(store)[0]["input_ids"].shape == (2,)  # v1 stores still open
    with caplog.at_level(logging.WARNING, logger="thdpack.data.store_verify"):
        result = verify_store(store)
    assert not result.checksums and "(no checksums: v1)" in str(result)
    assert (
        f"{store / 'manifest.json'} has no checksums (store version 1, written by thdpack 0.1.0): checking its "
        "structure and token ids only; a changed byte cannot be detected. Add checksums: `thdpack prepare ... "
        f"--out {store} --overwrite`"
    ) in caplog.text
    with pytest.raises(StoreError, match=re.escape(f"{store / 'manifest.json'} has no checksums (store version 1")):
        verify_store(store, require_checksums=True)
    overwrite(store / "tokens.bin", "uint16", set_at(7, 65000))  # ids are still checked
    with pytest.raises(StoreError, match=r"tokens.bin holds token id 65000 at token 7 \(sample 2\)"):
        verify_store(store)


def test_unknown_versions_and_formats_are_refused(store):
    edit_manifest(store, lambda m: m.update(version=3))
    with pytest.raises(StoreError, match=r"manifest.json has version 3; this thdpack reads versions \[1, 2\]; upgrade"):
        TokenStore(store)
    (store / "manifest.json").write_text("[1, 2]")
    with pytest.raises(StoreError, match=r"manifest.json is not a thdpack-token-store manifest \(format='list'\)"):
        TokenStore(store)


def test_store_errors_pickle_with_their_parts(store):
    err = StoreError(store / "tokens.bin", "is missing")
    clone = pickle.loads(pickle.dumps(err))
    assert (clone.file, clone.problem, clone.fix, str(clone)) == (err.file, err.problem, err.fix, str(err))


def test_a_second_writer_is_refused_while_the_first_holds_the_folder(tmp_path, gpt2):
    folder = tmp_path / "store"
    lock = FolderLock(folder).acquire()
    busy = rf"{folder} is being written by another process \(pid \d+ on .*; lock file {tmp_path / '.store.lock'}\)"
    with pytest.raises(StoreBusyError, match=busy + "; wait for it to finish, or write to another folder"):
        TokenStoreWriter(folder, tokenizer=gpt2, overwrite=True)
    lock.release()
    assert not (tmp_path / ".store.lock").exists()  # the holder removes its lock file
    make_store(folder, gpt2)
    assert not (tmp_path / ".store.lock").exists()
    with FolderLock(folder), pytest.raises(StoreBusyError, match=busy + "; wait for it to finish, then run again"):
        verify_store(folder)  # a reader is told the store is being written, not that it is damaged
    assert verify_store(folder).num_samples == 20


def test_a_failed_writer_releases_the_folder(tmp_path, gpt2):
    folder = tmp_path / "store"
    with pytest.raises(ValueError, match="outside"), TokenStoreWriter(folder, tokenizer=gpt2) as writer:
        writer.add(TokenizedSample(np.array([1, 70000]), np.ones(2, bool)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"] and not any(folder.iterdir())
    make_store(folder, gpt2)  # not locked


def test_a_file_is_no_store_folder(tmp_path, gpt2):
    (tmp_path / "out").write_text("notes")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'out'} is an existing file, not a folder")):
        TokenStoreWriter(tmp_path / "out", tokenizer=gpt2)
    assert (tmp_path / "out").read_text() == "notes"
