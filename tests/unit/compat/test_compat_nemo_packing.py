"""NeMo AutoModel drop-ins: pack_dataset (P1-P13), the THD collater (C1-C4), block-causal masks.

Golden vectors from research/nemo_te_spec.md §1.2.5, §1.3, §1.4 (NeMo run on CPU).
"""

from __future__ import annotations

import itertools
import logging
import sys
import types

import pytest
import torch

from thdpack.compat.nemo import create_block_causal_mask, pack_dataset, packed_sequence_thd_collater

N = -100
BASE = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]


def rows(ids, labels=None, loss_mask=None):
    out = []
    for i, x in enumerate(ids):
        sample = {"input_ids": list(x), "labels": list(x if labels is None else labels[i])}
        if loss_mask is not None:
            sample["loss_mask"] = list(loss_mask[i])
        out.append(sample)
    return out


def packs_of(*args, **kwargs):
    result = pack_dataset(*args, **kwargs)
    return [dict(result[i]) for i in range(len(result))]


def test_p1_basic_packing():
    p0, p1 = packs_of(rows(BASE), "train", 10)
    assert p0 == {
        "input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 0],
        "labels": [1, 2, 3, 4, 5, 6, 7, 8, 9, N],
        "position_ids": [0, 1, 2, 0, 1, 2, 3, 0, 1, 2],
        "seq_lens": [3, 4, 2],
        "seq_lens_padded": [3, 4, 3],
    }
    assert p1 == {
        "input_ids": [10, 11, 12, 13, 14, 0, 0, 0, 0, 0],
        "labels": [10, 11, 12, 13, 14, N, N, N, N, N],
        "position_ids": list(range(10)),
        "seq_lens": [5],
        "seq_lens_padded": [10],
    }
    assert list(p0) == ["input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded"]


def test_p2_one_sample_per_pack_and_max_packs():
    packs = packs_of(rows(BASE), "train", 5)
    assert [p["input_ids"] for p in packs] == [
        [1, 2, 3, 0, 0],
        [4, 5, 6, 7, 0],
        [8, 9, 0, 0, 0],
        [10, 11, 12, 13, 14],
    ]
    assert [p["seq_lens"] for p in packs] == [[3], [4], [2], [5]]
    assert [p["seq_lens_padded"] for p in packs] == [[5]] * 4
    assert packs[0]["position_ids"] == [0, 1, 2, 3, 4]
    assert packs_of(rows(BASE), "train", 5, max_packs=2) == packs[:2]
    assert packs_of(rows(BASE), "train", 5, max_packs=3) == packs[:3]


def test_max_packs_stops_reading_an_endless_dataset():
    endless = ({"input_ids": [1, 2, 3], "labels": [1, 2, 3]} for _ in itertools.count())
    packs = packs_of(endless, "train", 8, max_packs=2)
    assert [p["seq_lens"] for p in packs] == [[3, 3], [3, 3]]


def test_p3_loss_mask():
    samples = rows([[1, 2, 3], [4, 5, 6]], loss_mask=[[1, 1, 0], [1, 1, 1]])
    p0, p1 = packs_of(samples, "train", 5)
    assert (p0["input_ids"], p0["labels"]) == ([1, 2, 3, 0, 0], [1, 2, N, N, N])
    assert (p0["seq_lens"], p0["seq_lens_padded"]) == ([3], [5])
    assert (p1["input_ids"], p1["labels"]) == ([4, 5, 6, 0, 0], [4, 5, 6, N, N])


def test_p4_seq_lens_padded():
    (p,) = packs_of(rows([[1, 2, 3], [4, 5], [6, 7, 8, 9]]), "train", 13)
    assert p["input_ids"] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0, 0]
    assert p["position_ids"] == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5, 6, 7]
    assert (p["seq_lens"], p["seq_lens_padded"]) == ([3, 2, 4], [3, 2, 8])


def test_p5_cp_aware_packing():
    (p,) = packs_of(rows([[1, 2, 3], [4, 5, 6, 7, 8]]), "train", 16, cp_size=2)
    assert p["input_ids"] == [1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0]
    assert p["labels"] == [1, 2, 3, N, 4, 5, 6, 7, 8] + [N] * 7
    assert p["position_ids"] == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert (p["seq_lens"], p["seq_lens_padded"]) == ([3, 5], [4, 12])


def test_p6_cp_aware_packing_multiple_sequences():
    (p,) = packs_of(rows([[1, 2, 3], [4, 5], [6]]), "train", 20, cp_size=2)
    assert p["input_ids"] == [1, 2, 3, 0, 4, 5, 0, 0, 6] + [0] * 11
    assert p["labels"] == [1, 2, 3, N, 4, 5, N, N, 6] + [N] * 11
    assert p["position_ids"] == [0, 1, 2, 3, 0, 1, 2, 3, *range(12)]
    assert (p["seq_lens"], p["seq_lens_padded"]) == ([3, 2, 1], [4, 4, 12])


def test_p7_single_sample_cp4():
    (p,) = packs_of(rows([[1, 2, 3, 4, 5]]), "train", 16, cp_size=4)
    assert (p["seq_lens"], p["seq_lens_padded"], p["position_ids"]) == ([5], [16], list(range(16)))


@pytest.mark.parametrize(("size", "cp_size", "fix"), [(10, 2, "use pack_size=12 or 8"), (6, 2, "pack_size=8 or 4")])
def test_p7_and_broken_configuration_raise(size, cp_size, fix):
    # NeMo gives seq_lens_padded [10] for P=10, cp=2 (TE then mis-partitions), or crashes / corrupts packs
    with pytest.raises(ValueError, match=rf"pack_size={size} is not a multiple of 2\*cp_size=4.*{fix}"):
        pack_dataset(rows([[1, 2, 3, 4, 5]]), "train", size, cp_size=cp_size)


def test_p8_long_samples_dropped_with_a_warning(caplog):
    samples = rows([[1, 2], [3, 4, 5, 6, 7, 8], [9, 10, 11]])
    with caplog.at_level(logging.WARNING, logger="thdpack"):
        (p,) = packs_of(samples, "train", 5)
    assert p == {
        "input_ids": [1, 2, 9, 10, 11],
        "labels": [1, 2, 9, 10, 11],
        "position_ids": [0, 1, 0, 1, 2],
        "seq_lens": [2, 3],
        "seq_lens_padded": [2, 3],
    }
    assert "dropped 1 samples longer than packed_sequence_size=5 (6 tokens)" in caplog.text


def test_p8_long_sample_raises_without_drop():
    with pytest.raises(ValueError, match=r"Dataset sample 1 is too long \(6 > 5\)"):
        pack_dataset(rows([[1, 2], [3, 4, 5, 6, 7, 8], [9, 10, 11]]), "train", 5, drop_long_samples=False)


def test_p9_exact_fill_has_no_padding():
    p0, p1 = packs_of(rows([[1, 2, 3], [4, 5], [6, 7, 8]]), "train", 5)
    assert (p0["input_ids"], p0["seq_lens"], p0["seq_lens_padded"]) == ([1, 2, 3, 4, 5], [3, 2], [3, 2])
    assert (p1["input_ids"], p1["seq_lens"], p1["seq_lens_padded"]) == ([6, 7, 8, 0, 0], [3], [5])


def test_p10_all_zero_loss_mask():
    samples = rows([[1, 2, 3], [4, 5]], labels=[[7, 8, 9], [10, 11]], loss_mask=[[0, 0, 0], [0, 1]])
    (p,) = packs_of(samples, "train", 8)
    assert p["input_ids"] == [1, 2, 3, 4, 5, 0, 0, 0]
    assert p["labels"] == [N, N, N, N, 11, N, N, N]
    assert (p["seq_lens"], p["seq_lens_padded"]) == ([3, 2], [3, 5])


def test_empty_loss_mask_is_ignored_as_in_nemo():
    samples = [{"input_ids": [1, 2], "labels": [3, 4], "loss_mask": []}]
    (p,) = packs_of(samples, "train", 4)
    assert p["labels"] == [3, 4, N, N]


def test_p11_padding_idx():
    (p,) = packs_of(rows([[1, 2, 3], [4, 5]]), "train", 8, padding_idx=99)
    assert p["input_ids"] == [1, 2, 3, 4, 5, 99, 99, 99]
    assert p["labels"] == [1, 2, 3, 4, 5, N, N, N]
    assert p["seq_lens_padded"] == [3, 5]


def test_p12_cp_pad_label_independent_of_padding_idx():
    samples = rows([[1, 2, 3], [4, 5, 6, 7, 8]], labels=[[N, 2, 3], [4, 5, 6, 7, N]])
    (p,) = packs_of(samples, "train", 12, cp_size=2, padding_idx=7)
    assert p["input_ids"] == [1, 2, 3, 7, 4, 5, 6, 7, 8, 7, 7, 7]
    assert p["labels"] == [N, 2, 3, N, 4, 5, 6, 7, N, N, N, N]
    assert p["position_ids"] == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]
    assert (p["seq_lens"], p["seq_lens_padded"]) == ([3, 5], [4, 8])


def test_p13_no_packs():
    with pytest.raises(ValueError, match="No packs were produced: the dataset is empty"):
        pack_dataset([], "train", 8)
    with pytest.raises(ValueError, match=r"No packs were produced.*all of its samples \(1\) are longer than 4"):
        pack_dataset(rows([[1, 2, 3, 4, 5]]), "train", 4)


def test_samples_are_not_modified():
    samples = rows([[1, 2, 3]], loss_mask=[[0, 1, 1]])
    packs_of(samples, "train", 4)
    assert samples == [{"input_ids": [1, 2, 3], "labels": [1, 2, 3], "loss_mask": [0, 1, 1]}]


def test_split_selection():
    splits = {"train": rows([[1, 2]]), "validation": rows([[3]])}
    assert packs_of(splits, "validation", 2)[0]["input_ids"] == [3, 0]
    with pytest.raises(
        ValueError, match=r"split 'test' is not in the dataset; its splits are \['train', 'validation'\]"
    ):
        pack_dataset(splits, "test", 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_packs must be None or >= 1, got 0"):
        pack_dataset(rows([[1]]), "train", 2, max_packs=0)
    with pytest.raises(ValueError, match="sample 1: labels has 1 tokens but input_ids has 2"):
        pack_dataset([{"input_ids": [1], "labels": [1]}, {"input_ids": [1, 2], "labels": [1]}], "train", 4)


def test_labels_are_derived_when_absent():
    (p,) = packs_of([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}], "train", 6)
    assert p["labels"] == [6, 7, N, 9, N, N]


# -- packed_sequence_thd_collater (C1-C4) ------------------------------------------------------
def _p5_and_second_pack():
    (a,) = packs_of(rows([[1, 2, 3], [4, 5, 6, 7, 8]]), "train", 16, cp_size=2)
    (b,) = packs_of(rows([[1, 2, 3], [4, 5], [6]]), "train", 16, cp_size=2)
    assert b["input_ids"] == [1, 2, 3, 0, 4, 5, 0, 0, 6] + [0] * 7 and b["seq_lens_padded"] == [4, 4, 8]
    return a, b


def test_c1_collate_cp_packs():
    a, b = _p5_and_second_pack()
    out = packed_sequence_thd_collater([a, b])
    assert list(out) == ["input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded", "qkv_format"]
    assert out["seq_lens"].tolist() == [[3, 5, -1000], [3, 2, 1]]
    assert out["seq_lens_padded"].tolist() == [[4, 12, -1000], [4, 4, 8]]
    assert out["seq_lens"].dtype == torch.int64 and out["seq_lens_padded"].dtype == torch.int64
    for key in ("input_ids", "labels", "position_ids"):
        assert out[key].shape == (2, 16) and out[key].dtype == torch.int64
    assert out["input_ids"][1].tolist() == b["input_ids"] and out["qkv_format"] == "thd"


def test_c2_collate_plain_packs():
    out = packed_sequence_thd_collater(packs_of(rows(BASE), "train", 10))
    assert out["seq_lens"].tolist() == [[3, 4, 2], [5, -1000, -1000]]
    assert out["seq_lens_padded"].tolist() == [[3, 4, 3], [10, -1000, -1000]]


def test_c3_unpacked_items_with_attention_mask():
    items = [
        {"input_ids": [1, 2, 3], "labels": [10, 20, 30], "attention_mask": [1, 1, 1]},
        {"input_ids": [4, 5, 6, 7, 8], "labels": [40, 50, 60, 70, 80], "attention_mask": [1, 1, 1, 1, 0]},
    ]
    out = packed_sequence_thd_collater(items)
    assert out["input_ids"].tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]]
    assert out["labels"].tolist() == [[10, 20, 30, N, N], [40, 50, 60, 70, 80]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 4]] * 2
    assert out["seq_lens"].tolist() == [[3], [4]] and out["seq_lens_padded"].tolist() == [[5], [5]]
    assert "attention_mask" not in out and "attention_mask" in items[1]


def test_c4_unpacked_items_pad_id():
    items = [
        {"input_ids": [1, 2], "labels": [2, N], "___PAD_TOKEN_IDS___": {"input_ids": 99}},
        {"input_ids": [3, 4, 5, 6], "labels": [4, 5, 6, N], "___PAD_TOKEN_IDS___": {"input_ids": 99}},
    ]
    out = packed_sequence_thd_collater(items)
    assert out["input_ids"].tolist() == [[1, 2, 99, 99], [3, 4, 5, 6]]
    assert out["seq_lens"].tolist() == [[2], [4]] and out["seq_lens_padded"].tolist() == [[4], [4]]
    assert "___PAD_TOKEN_IDS___" in items[0]


def test_collater_edge_cases():
    assert packed_sequence_thd_collater([]) == {}
    a, _ = _p5_and_second_pack()
    (short,) = packs_of(rows([[1, 2]]), "train", 8)
    # NeMo's torch.stack raises RuntimeError there: the error is that too, and a ValueError
    with pytest.raises(
        RuntimeError, match=r"packs must all have the same length \(pack_size\) to stack; got \[16, 8\]"
    ):
        packed_sequence_thd_collater([a, short])
    with pytest.raises(ValueError, match=r"packs must all have the same length"):
        packed_sequence_thd_collater([a, short])
    with pytest.raises(ValueError, match="item 0 has no 'labels'"):
        packed_sequence_thd_collater([{"input_ids": [1]}])


# -- create_block_causal_mask ------------------------------------------------------------------
def _bits(mask):
    return ["".join(str(int(v)) for v in row) for row in mask.tolist()]


def test_block_causal_mask_golden():
    m = create_block_causal_mask([torch.tensor([3, 2, 1])])
    assert m.shape == (1, 1, 6, 6) and m.dtype == torch.bool
    assert _bits(m[0, 0]) == ["100000", "110000", "111000", "000100", "000110", "000001"]
    m = create_block_causal_mask([torch.tensor([2, 2]), torch.tensor([3, 1])])
    assert _bits(m[0, 0]) == ["1000", "1100", "0010", "0011"]
    assert _bits(m[1, 0]) == ["1000", "1100", "1110", "0001"]


def test_block_causal_mask_ignores_the_collater_filler():
    m = create_block_causal_mask(torch.tensor([[2, 2], [3, 1]]))
    assert torch.equal(m, create_block_causal_mask(torch.tensor([[2, 2, -1000], [3, 1, -1000]])))


def test_block_causal_mask_rows_must_cover_the_same_length():
    with pytest.raises(ValueError, match=r"rows sum to different lengths \[4, 3\].*pass seq_lens_padded"):
        create_block_causal_mask([torch.tensor([2, 2]), torch.tensor([3])])


def test_returns_an_hf_dataset_when_datasets_is_installed(monkeypatch):
    class FakeDataset:
        @classmethod
        def from_dict(cls, columns):
            made = cls()
            made.columns = columns
            return made

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(Dataset=FakeDataset))
    monkeypatch.setattr("thdpack.compat._nemo_packing.has_module", lambda name: name == "datasets")
    made = pack_dataset(rows(BASE), "train", 10)
    assert isinstance(made, FakeDataset)
    assert made.columns["seq_lens"] == [[3, 4, 2], [5]]
    assert list(made.columns) == ["input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded"]


# -- issue 9: the collater checks widths and refuses mixed batches -----------------------------
def test_collater_checks_label_width_and_mixed_items():
    (pack,) = packs_of(rows([[1, 2, 3], [4, 5]]), "train", 8)
    short = {**pack, "labels": pack["labels"][:5]}
    with pytest.raises(ValueError, match=r"pack 0 has labels of shape \(5,\) but pack 0 has 8 tokens"):
        packed_sequence_thd_collater([short])
    single = {"input_ids": [1, 2, 3], "labels": [2, 3, -100]}
    with pytest.raises(ValueError, match="item 0 is a sequence but item 1 is a pack; a batch holds either packs"):
        packed_sequence_thd_collater([single, pack])
    with pytest.raises(ValueError, match="item 0 is a pack but item 1 is a sequence"):
        packed_sequence_thd_collater([pack, single])
    no_positions = {k: v for k, v in pack.items() if k != "position_ids"}
    with pytest.raises(ValueError, match=r"pack 0 lacks \['position_ids'\]"):
        packed_sequence_thd_collater([no_positions])
    with pytest.raises(ValueError, match=r"item 0 has labels of shape \(2,\) but input_ids of shape \(3,\)"):
        packed_sequence_thd_collater([{"input_ids": [1, 2, 3], "labels": [2, 3]}])


def test_collater_is_thdpack_collate(monkeypatch):
    import thdpack.compat._nemo_packing as nemo_packing

    calls = []
    real = nemo_packing.collate
    monkeypatch.setattr(nemo_packing, "collate", lambda packs: calls.append(len(packs)) or real(packs))
    (pack,) = packs_of(rows([[1, 2, 3], [4, 5]]), "train", 8)
    packed_sequence_thd_collater([pack, pack])
    packed_sequence_thd_collater([{"input_ids": [1, 2], "labels": [2, -100]}])
    assert calls == [2, 1]


# -- issue 17: the attention_mask of single sequences is honoured or refused -------------------
def test_a_left_padded_attention_mask_is_honoured():
    """NeMo takes sum(attention_mask) tokens from the front: with left padding the pads became the
    sequence (seq_lens [[3]] over [0, 0, 4]) and 5, 6 its padding. The real tokens lead now."""
    left = {"input_ids": [0, 0, 4, 5, 6], "labels": [N, N, 5, 6, N], "attention_mask": [0, 0, 1, 1, 1]}
    out = packed_sequence_thd_collater([left])
    assert out["input_ids"].tolist() == [[4, 5, 6, 0, 0]]
    assert out["labels"].tolist() == [[5, 6, N, N, N]]
    assert out["seq_lens"].tolist() == [[3]] and out["seq_lens_padded"].tolist() == [[5]]
    right = {"input_ids": [4, 5, 6, 0, 0], "labels": [5, 6, N, N, N], "attention_mask": [1, 1, 1, 0, 0]}
    for key in ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded"):
        assert torch.equal(out[key], packed_sequence_thd_collater([right])[key]), key
    assert left["input_ids"] == [0, 0, 4, 5, 6]  # the item is not modified


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        ([1, 0, 1, 1, 0], r"item 1 has attention_mask \[1, 0, 1, 1, 0\]: its tokens are not one run"),
        ([0, 1, 1, 0, 0], r"item 1 has attention_mask \[0, 1, 1, 0, 0\]: its tokens are not one run"),
        ([1, 1, 1], r"item 1 has attention_mask \[1, 1, 1\] for 5 input_ids"),
        ([1, 2, 1, 1, 1], r"item 1 has attention_mask \[1, 2, 1, 1, 1\] for 5 input_ids; give one 0"),
    ],
)
def test_an_attention_mask_that_is_not_one_run_is_refused_naming_the_item(mask, message):
    good = {"input_ids": [1, 2], "labels": [2, N]}
    bad = {"input_ids": [4, 5, 6, 7, 8], "labels": [5, 6, 7, 8, N], "attention_mask": mask}
    with pytest.raises(ValueError, match=message):
        packed_sequence_thd_collater([good, bad])
