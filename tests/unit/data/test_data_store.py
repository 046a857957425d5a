"""Token store: round trip through buffered writes, lengths without token reads, pickling, errors."""

from __future__ import annotations

import os
import pickle
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from thdpack.data import store as store_module
from thdpack.data.encode import TokenizedSample
from thdpack.data.store import StoreError, TokenStore, TokenStoreWriter, read_manifest, token_dtype
from thdpack.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


def sample(tokens, mask=None):
    tokens = np.asarray(tokens, dtype=np.int64)
    return TokenizedSample(tokens, np.ones(len(tokens), bool) if mask is None else np.asarray(mask, bool))


def written_out_store(path, gpt2):
    with TokenStoreWriter(path, tokenizer=gpt2, source={"format": "test"}) as writer:
        writer.add(sample([10, 11, 12]))
        writer.add(sample([20, 21], [False, True]))
        writer.add(sample([30, 31, 32, 33], [False, False, True, True]))
    return TokenStore(path)


def test_written_out_round_trip(tmp_path, gpt2):
    store = written_out_store(tmp_path, gpt2)
    assert len(store) == 3 and store.num_tokens == 9
    assert store.lengths.tolist() == [2, 1, 3] and store.lengths.dtype == np.int64
    assert store[0]["input_ids"].tolist() == [10, 11] and store[0]["labels"].tolist() == [11, 12]
    assert store[1]["labels"].tolist() == [21]
    assert store[-1]["input_ids"].tolist() == [30, 31, 32]
    assert store[-1]["labels"].tolist() == [-100, 32, 33]
    assert [s["labels"].tolist() for s in store[1:]] == [[21], [-100, 32, 33]]
    assert store[2]["input_ids"].dtype == np.int64
    as_mask = TokenStore(tmp_path, sample_format="loss_mask")
    assert as_mask.lengths.tolist() == [3, 2, 4]
    assert as_mask[2]["input_ids"].tolist() == [30, 31, 32, 33]
    assert as_mask[2]["loss_mask"].tolist() == [0, 1, 1, 0]
    manifest = read_manifest(tmp_path)
    assert manifest["dtype"] == "uint16" and manifest["has_loss_mask"]
    assert (manifest["num_samples"], manifest["num_tokens"], manifest["num_target_tokens"]) == (3, 9, 5)
    assert manifest["tokenizer"]["sha256"].startswith("e88dafdf") and manifest["source"] == {"format": "test"}
    assert manifest["created_by"].startswith("thdpack ")
    assert (tmp_path / "tokens.bin").stat().st_size == 9 * 2


def test_pretraining_store_has_no_mask_file(tmp_path, gpt2):
    with TokenStoreWriter(tmp_path, tokenizer=gpt2) as writer:
        writer.add_all([sample([1, 2]), sample([3, 4, 5])])
    assert not (tmp_path / "loss_mask.bin").exists()
    assert TokenStore(tmp_path)[1]["labels"].tolist() == [4, 5]


@given(
    rows=st.lists(
        st.lists(st.tuples(st.integers(0, 50256), st.booleans()), min_size=2, max_size=12),
        min_size=1,
        max_size=20,
    ),
    chunk=st.integers(1, 16),
)
def test_any_samples_round_trip_through_small_flushes(tmp_path_factory, gpt2, rows, chunk):
    path = tmp_path_factory.mktemp("store")
    original = store_module._CHUNK
    store_module._CHUNK = chunk  # many flushes; the mask file starts mid-stream and is back-filled
    try:
        with TokenStoreWriter(path, tokenizer=gpt2) as writer:
            writer.add_all(sample([t for t, _ in row], [m for _, m in row]) for row in rows)
    finally:
        store_module._CHUNK = original
    store = TokenStore(path)
    assert store.lengths.tolist() == [len(row) - 1 for row in rows]
    for i, row in enumerate(rows):
        got = store.tokenized(i)
        assert got.tokens.tolist() == [t for t, _ in row]
        if store.manifest["has_loss_mask"]:
            assert got.target_mask.tolist() == [m for _, m in row]
        else:
            assert all(m for _, m in row)


def test_pickles_without_the_data_and_reopens_lazily(tmp_path, gpt2):
    store = written_out_store(tmp_path, gpt2)
    _ = store[0], store.lengths  # maps the files in this process
    blob = pickle.dumps(store)
    assert len(blob) < 2000  # the manifest and the path, never the tokens
    clone = pickle.loads(blob)
    assert clone._tokens is None
    assert clone[2]["labels"].tolist() == [-100, 32, 33] and clone.lengths.tolist() == [2, 1, 3]
    loader = torch.utils.data.DataLoader(store, batch_size=None, num_workers=1, collate_fn=lambda s: s["input_ids"])
    assert [b.tolist() for b in loader] == [[10, 11], [20], [30, 31, 32]]


def test_dtype_follows_vocab_size():
    assert token_dtype(50257) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.int32 and token_dtype(152064) == np.int32


def test_int32_store_for_large_vocabularies(tmp_path, gpt2):
    big = type(gpt2).__new__(type(gpt2))
    big.__dict__.update(gpt2.__dict__, vocab_size=152064, name="big")
    with TokenStoreWriter(tmp_path, tokenizer=big) as writer:
        writer.add(sample([151000, 70000, 1]))
    store = TokenStore(tmp_path)
    assert store.manifest["dtype"] == "int32" and store[0]["labels"].tolist() == [70000, 1]


def test_writer_errors(tmp_path, gpt2):
    written_out_store(tmp_path, gpt2)
    with pytest.raises(FileExistsError, match=r"already holds token store files .* pass overwrite=True"):
        TokenStoreWriter(tmp_path, tokenizer=gpt2)
    with TokenStoreWriter(tmp_path, tokenizer=gpt2, overwrite=True) as writer:
        writer.add(sample([7, 8]))
    assert len(TokenStore(tmp_path)) == 1
    with (
        pytest.raises(ValueError, match=r"sample 1 has token id 50257, outside \[0, 50257\) of tokenizer 'gpt2'"),
        TokenStoreWriter(tmp_path / "ids", tokenizer=gpt2) as writer,
    ):
        writer.add_all([sample([1, 2]), sample([3, 50257])])
    assert sorted(p.name for p in (tmp_path / "ids").iterdir()) == []  # the failed store was removed
    with pytest.raises(ValueError, match=r"sample 0: tokens must be 1-D with >= 2 entries"):
        TokenStoreWriter(tmp_path / "short", tokenizer=gpt2).add(sample([1]))
    with pytest.raises(ValueError, match=r"unknown sample_format 'bshd'"):
        TokenStoreWriter(tmp_path / "fmt", tokenizer=gpt2, sample_format="bshd")


def test_reader_errors(tmp_path, gpt2):
    with pytest.raises(
        StoreError, match=r"manifest.json is missing: .* holds no finished token store; run `thdpack prepare"
    ):
        TokenStore(tmp_path)
    store = written_out_store(tmp_path, gpt2)
    with pytest.raises(IndexError, match="sample 3 is out of range for a store of 3 samples"):
        store[3]
    with pytest.raises(TypeError, match="store indices must be integers or slices, got str"):
        store["0"]
    with open(tmp_path / "tokens.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(StoreError, match=r"tokens.bin has 10 bytes, manifest.json implies 18 .*; the store is damaged"):
        TokenStore(tmp_path)


def test_packed_dataset_over_a_store_trains_the_same_targets_in_both_sample_formats(tmp_path, gpt2):
    from thdpack.data.encode import SampleEncoder
    from thdpack.packing.dataset import PackedDataset

    records = [{"instruction": f"Count to {i}.", "output": " ".join(map(str, range(i)))} for i in range(1, 9)]
    records += [{"text": "word " * n} for n in (5, 17, 2)]
    with TokenStoreWriter(tmp_path, tokenizer=gpt2) as writer:
        writer.add_all(SampleEncoder(gpt2).encode(records))
    pairs = {}
    for sample_format in ("labels", "loss_mask"):
        store = TokenStore(tmp_path, sample_format=sample_format)
        ds = PackedDataset(store, 64, cp_size=2, lengths=store.lengths, shuffle=False, pad_id=50256)
        packs = [ds[i] for i in range(len(ds))]
        assert sum(int(p["seq_lens"].sum()) for p in packs) == int(store.lengths.sum())  # tokens conserved
        trained = [
            (int(t), int(lb)) for p in packs for t, lb in zip(p["input_ids"], p["labels"], strict=True) if lb != -100
        ]
        pairs[sample_format] = sorted(trained)
    assert (
        pairs["labels"] == pairs["loss_mask"]
        and len(pairs["labels"]) == TokenStore(tmp_path).manifest["num_target_tokens"]
    )


def cut_short(path):
    with open(path / "tokens.bin", "r+b") as f:
        f.truncate(4)
    return "has 4 bytes, 18 when it was opened (cut short or rewritten)"


def replaced(path):
    copy = path / "loss_mask.bin.new"
    copy.write_bytes((path / "loss_mask.bin").read_bytes())
    os.replace(copy, path / "loss_mask.bin")  # the same bytes in another file
    return "was replaced by another file"


def touched(path):
    stat = (path / "offsets.npy").stat()
    os.utime(path / "offsets.npy", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    return "was modified"


@pytest.mark.parametrize("change", [cut_short, replaced, touched], ids=["cut short", "replaced", "touched"])
def test_a_store_file_changed_while_mapped_is_named(tmp_path, gpt2, change):
    """A memory-mapped file cut short kills its reader with SIGBUS: the store checks first (issue 17)."""
    store = written_out_store(tmp_path, gpt2)
    store.check_unchanged()  # nothing mapped yet: nothing to compare
    assert store[0]["input_ids"].tolist() == [10, 11]
    store.check_unchanged()
    said = change(tmp_path)
    name = {"cut_short": "tokens.bin", "replaced": "loss_mask.bin", "touched": "offsets.npy"}[change.__name__]
    with pytest.raises(StoreError, match=re.escape(f"{tmp_path / name} {said} while this process was reading")):
        store.check_unchanged()
