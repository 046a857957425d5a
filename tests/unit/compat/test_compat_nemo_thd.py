"""NeMo AutoModel drop-ins: process_input_for_thd / split_batch_into_thd_chunks (T1-T8, current
generation) and make_cp_batch_for_te without a CP mesh. Golden vectors: nemo_te_spec.md §1.5.3, §1.6."""

from __future__ import annotations

import pytest
import torch

from thdpack.compat.nemo import (
    NemoKeyError,
    make_cp_batch_for_te,
    pack_dataset,
    packed_sequence_thd_collater,
    process_input_for_thd,
    split_batch_into_thd_chunks,
)

N = -100
BASE = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]


def packs(ids, size, cp_size=1):
    made = pack_dataset([{"input_ids": x, "labels": x} for x in ids], "train", size, cp_size=cp_size)
    return [dict(made[i]) for i in range(len(made))]


def c1():
    return packed_sequence_thd_collater(
        packs([[1, 2, 3], [4, 5, 6, 7, 8]], 16, cp_size=2) + packs([[1, 2, 3], [4, 5], [6]], 16, cp_size=2)
    )


def c2():
    return packed_sequence_thd_collater(packs(BASE, 10))


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


def where(mask):
    return mask.nonzero().flatten().tolist()


def test_t1_two_plain_packs():
    out = process_input_for_thd(c2())
    assert out["input_ids"].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 10, 11, 12, 13, 14, 0, 0, 0, 0, 0]
    assert out["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, *range(10)]
    assert torch.equal(out["cu_seqlens"], i32([0, 3, 7, 9, 14]))
    assert torch.equal(out["cu_seqlens_padded"], i32([0, 3, 7, 10, 20]))
    assert out["max_seqlen"].dtype == torch.int32 and out["max_seqlen"].dim() == 0 and int(out["max_seqlen"]) == 5
    assert where(out["padding_mask"]) == [9, 15, 16, 17, 18, 19]
    assert list(out) == [
        "input_ids", "position_ids", "cu_seqlens", "labels", "padding_mask", "cu_seqlens_padded", "max_seqlen",
        "qkv_format",
    ]  # fmt: skip


@pytest.mark.parametrize(("pack", "cu", "max_seqlen"), [(0, [0, 3, 7, 10], 4), (1, [0, 10], 10)])
def test_t1b_t1c_trailing_pad_is_absorbed(pack, cu, max_seqlen):
    out = process_input_for_thd(packed_sequence_thd_collater([packs(BASE, 10)[pack]]))
    assert torch.equal(out["cu_seqlens"], i32(cu)) and "cu_seqlens_padded" not in out
    assert int(out["max_seqlen"]) == max_seqlen


def test_t2_cp_packs():
    out = process_input_for_thd(c1())
    assert torch.equal(out["cu_seqlens"], i32([0, 3, 8, 11, 13, 14]))
    assert torch.equal(out["cu_seqlens_padded"], i32([0, 4, 16, 20, 24, 32]))
    assert int(out["max_seqlen"]) == 5
    assert where(out["padding_mask"]) == [3, *range(9, 16), *(16 + i for i in (3, 6, 7, *range(9, 16)))]


def t3_batch():
    return {
        "input_ids": torch.tensor([[1, 2, 3, 99, 4, 5], [6, 7, 8, 9, 10, 11]]),
        "labels": torch.tensor([[2, 3, 99, 4, 5, 6], [7, 8, 9, 10, 11, 12]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5]]),
        "seq_lens": torch.tensor([[3, 2], [6, -1000]]),
        "seq_lens_padded": torch.tensor([[4, 2], [6, -1000]]),
    }


def test_t3_variable_number_of_sequences():
    out = process_input_for_thd(t3_batch())
    assert torch.equal(out["cu_seqlens"], i32([0, 3, 5, 11]))
    assert torch.equal(out["cu_seqlens_padded"], i32([0, 4, 6, 12]))
    assert int(out["max_seqlen"]) == 6 and where(out["padding_mask"]) == [3]
    assert out["input_ids"].shape == (12,) and out["labels"].shape == (12,)


def test_t4_multiple_packed_sequences():
    batch = {
        "input_ids": torch.arange(12).reshape(2, 6),
        "labels": torch.arange(12).reshape(2, 6),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]),
        "seq_lens": torch.tensor([[3, 2], [2, 3]]),
        "seq_lens_padded": torch.tensor([[4, 2], [3, 3]]),
    }
    out = process_input_for_thd(batch)
    assert torch.equal(out["cu_seqlens"], i32([0, 3, 5, 7, 10]))
    assert torch.equal(out["cu_seqlens_padded"], i32([0, 4, 6, 9, 12]))


@pytest.mark.parametrize(
    ("real", "padded", "cu", "max_seqlen"),
    [
        ([112] * 5, [112] * 4 + [576], [0, 112, 224, 336, 448, 1024], 576),
        ([112] * 9, [112] * 8 + [128], [112 * i for i in range(9)] + [1024], 128),
    ],
)
def test_t5_absorption(real, padded, cu, max_seqlen):
    batch = {
        "input_ids": torch.zeros(1, 1024, dtype=torch.int64),
        "labels": torch.zeros(1, 1024, dtype=torch.int64),
        "position_ids": torch.zeros(1, 1024, dtype=torch.int64),
        "seq_lens": torch.tensor([real]),
        "seq_lens_padded": torch.tensor([padded]),
    }
    out = process_input_for_thd(batch)
    assert torch.equal(out["cu_seqlens"], i32(cu)) and "cu_seqlens_padded" not in out
    assert int(out["max_seqlen"]) == max_seqlen


def t6_batch(row2_padded):
    return {
        "input_ids": torch.tensor(
            [[1, 2, 3, 99, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 99, 99], [16, 17, 99, 18, 19, 20]]
        ),
        "labels": torch.arange(24).reshape(4, 6),
        "position_ids": torch.tensor([[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 0, 0], [0, 1, 0, 0, 1, 2]]),
        "seq_lens": torch.tensor([[3, 2, -1000], [6, -1000, -1000], [4, -1000, -1000], [2, 3, -1000]]),
        "seq_lens_padded": torch.tensor([[4, 2, -1000], [6, -1000, -1000], [row2_padded, -1000, -1000], [3, 3, -1000]]),
    }


def test_t6_split_into_chunks():
    # NeMo's own test lists row 2 (6 tokens) with seq_lens_padded [4]: its last 2 tokens belong to
    # no sequence, so every later boundary of the chunk points 2 tokens early. thdpack refuses that ...
    with pytest.raises(
        ValueError, match=r"chunk 1 \(rows 2-3\): pack 0: seq_lens_padded=\[4\] sums to 4, not the pack length 6"
    ):
        split_batch_into_thd_chunks(t6_batch(row2_padded=4), 2)
    # ... and with the row's padding listed, the real boundaries are NeMo's, the padded ones correct
    out = split_batch_into_thd_chunks(t6_batch(row2_padded=6), 2)
    assert out["cu_seqlens"].tolist() == [[0, 3, 5, 11], [0, 4, 6, 9]]
    assert out["cu_seqlens_padded"].tolist() == [[0, 4, 6, 12], [0, 6, 9, 12]]
    assert out["max_seqlen"].tolist() == [6, 4] and out["cu_seqlens"].dtype == torch.int32
    assert out["input_ids"].shape == (2, 12) and out["padding_mask"].shape == (2, 12)
    assert where(out["padding_mask"][1]) == [4, 5, 8]


def test_t7_split_plain_packs():
    out = split_batch_into_thd_chunks(c2(), 2)
    assert out["cu_seqlens"].tolist() == [[0, 3, 7, 10], [0, 10, -1000, -1000]]
    assert out["max_seqlen"].tolist() == [4, 10] and "cu_seqlens_padded" not in out
    assert out["qkv_format"] == "thd"


def test_t8_padding_mask_from_layout_not_token_values():
    eos = 5  # pad id equal to a real token (EOS as pad)
    batch = {
        "input_ids": torch.tensor([[7, 8, eos, eos, 9, 10, eos, eos]]),
        "labels": torch.zeros(1, 8, dtype=torch.int64),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]),
        "seq_lens": torch.tensor([[3, 3]]),
        "seq_lens_padded": torch.tensor([[4, 4]]),
    }
    out = process_input_for_thd(batch, padding_token_id=eos)
    assert out["padding_mask"].tolist() == [False, False, False, True, False, False, False, True]
    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 0, 0, 0]]),
        "labels": torch.zeros(1, 6, dtype=torch.int64),
        "position_ids": torch.arange(6)[None],
        "seq_lens": torch.tensor([[3]]),
        "seq_lens_padded": torch.tensor([[3]]),
    }
    assert process_input_for_thd(batch)["padding_mask"].tolist() == [False] * 3 + [True] * 3


def test_embeddings_mrope_and_missing_padded_lengths():
    batch = {**t3_batch(), "input_ids": torch.randn(2, 6, 4), "position_ids": torch.zeros(3, 2, 6)}
    out = process_input_for_thd(batch)
    assert out["input_ids"].shape == (12, 4) and out["position_ids"].shape == (3, 1, 12)
    out = process_input_for_thd({**t3_batch(), "seq_lens_padded": None, "seq_lens": torch.tensor([[4, 2], [6, -1000]])})
    assert torch.equal(out["cu_seqlens"], i32([0, 4, 6, 12])) and "cu_seqlens_padded" not in out


def test_bad_batches():
    with pytest.raises(
        ValueError, match=r"batch\['seq_lens'\] is missing or None: thdpack derives cu_seqlens and padding_mask"
    ):
        process_input_for_thd({**t3_batch(), "seq_lens": None})
    bad = {**t3_batch(), "seq_lens": torch.tensor([[5, 2], [6, -1000]])}
    with pytest.raises(ValueError, match="pack 0: sequence 0 has 5 real tokens but a padded slot of 4"):
        process_input_for_thd(bad)
    bad = {**t3_batch(), "seq_lens_padded": torch.tensor([[4, -1000], [6, -1000]])}
    with pytest.raises(ValueError, match=r"pack 0: seq_lens\[1\]=2 but seq_lens_padded\[1\]=-1000"):
        process_input_for_thd(bad)
    bad = {**t3_batch(), "seq_lens_padded": torch.tensor([[4, 4], [6, -1000]])}
    with pytest.raises(ValueError, match=r"pack 0: seq_lens_padded=\[4, 4\] sums to 8, not the pack length 6"):
        process_input_for_thd(bad)
    three_rows = {key: torch.cat([value, value[:1]]) for key, value in t3_batch().items()}
    with pytest.raises(
        ValueError, match=r"batch has B=3 rows, not divisible by num_chunks=2 \(NeMo would silently drop 1 rows\)"
    ):
        split_batch_into_thd_chunks(three_rows, 2)
    with pytest.raises(ValueError, match=r"does not support 3-D \(mRoPE\) position_ids"):
        split_batch_into_thd_chunks({**t3_batch(), "position_ids": torch.zeros(3, 2, 6)}, 2)


def test_make_cp_batch_for_te_without_mesh():
    # S2, second part: the P6 pack alone, unsharded
    batch = packed_sequence_thd_collater(packs([[1, 2, 3], [4, 5], [6]], 20, cp_size=2))
    out = make_cp_batch_for_te(None, batch)
    assert torch.equal(out["cu_seqlens"], i32([0, 3, 5, 6]))
    assert torch.equal(out["cu_seqlens_padded"], i32([0, 4, 8, 20]))
    assert int(out["max_seqlen"]) == 3
    out, local = make_cp_batch_for_te(None, batch, return_local_indices=True)
    assert local.tolist() == list(range(20))
    out, local = make_cp_batch_for_te(None, c1(), num_chunks=2, return_local_indices=True)
    assert local is None and out["cu_seqlens"].shape[0] == 2


class SizeOneMesh:
    def size(self):
        return 1

    def get_group(self):
        raise AssertionError("a CP group of one is never asked for its rank")


def test_make_cp_batch_for_te_size_one_mesh_and_errors():
    assert torch.equal(
        make_cp_batch_for_te(SizeOneMesh(), c1())["cu_seqlens"], process_input_for_thd(c1())["cu_seqlens"]
    )
    with pytest.raises(ValueError, match="Currently only 'thd' format is supported, got: bshd"):
        make_cp_batch_for_te(None, c1(), qkv_format="bshd")
    with pytest.raises(ValueError, match="num_chunks > 1 needs the collated BSHD batch"):
        make_cp_batch_for_te(None, process_input_for_thd(c1()), num_chunks=2)


# -- issue 9: every width is checked against input_ids ------------------------------------------
class _FakeMesh:
    """A CP mesh of size 1 (no group needed): make_cp_batch_for_te's unsharded path."""

    def size(self):
        return 1

    def get_group(self):
        return None


WIDE = torch.arange(32).reshape(2, 16)


@pytest.mark.parametrize("convert", [process_input_for_thd, lambda b: make_cp_batch_for_te(_FakeMesh(), b)])
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"labels": WIDE}, r"labels has shape \(2, 16\) but input_ids is \(2, 6, ...\); give one .* label per token"),
        ({"labels": WIDE[:, :3]}, r"labels has shape \(2, 3\) but input_ids is \(2, 6, ...\)"),
        ({"position_ids": WIDE}, r"position_ids has shape \(2, 16\) but input_ids is \(2, 6, ...\)"),
        ({"seq_lens": torch.tensor([[3, -2], [6, -1000]])}, "pack 0: sequence 1 has seq_lens=-2, seq_lens_padded=2"),
        ({"seq_lens": torch.tensor([3, 2])}, r"seq_lens has shape \(2,\) but input_ids has B=2 rows"),
    ],
)
def test_widths_and_lengths_are_checked_against_input_ids(convert, change, message):
    with pytest.raises(ValueError, match=message):
        convert({**t3_batch(), **change})


def test_the_drop_ins_call_the_core(monkeypatch):
    """process_input_for_thd is thdpack.to_thd, split_batch_into_thd_chunks thdpack.thd.split_micro_batches
    (then to_thd per chunk); a fault only the core checks surfaces with the core's words."""
    import thdpack.compat._nemo_thd as nemo_thd

    calls = []
    for name in ("to_thd", "split_micro_batches"):
        real = getattr(nemo_thd, name)
        monkeypatch.setattr(nemo_thd, name, lambda *args, _real=real, _name=name: calls.append(_name) or _real(*args))
    process_input_for_thd(t3_batch())
    assert calls == ["to_thd"]
    split_batch_into_thd_chunks(t3_batch(), 2)
    assert calls == ["to_thd", "split_micro_batches", "to_thd", "to_thd"]
    bad = {**t3_batch(), "seq_lens": torch.tensor([[5, 2], [6, -1000]])}
    for convert in (process_input_for_thd, lambda b: make_cp_batch_for_te(_FakeMesh(), b)):
        with pytest.raises(ValueError, match="pack 0: sequence 0 has 5 real tokens but a padded slot of 4"):
            convert(bad)


def test_a_batch_without_seq_lens_raises_nemos_key_error_too():
    """NeMo raises KeyError('seq_lens') there (make_cp_batch_for_te); a caller's ``except KeyError``
    must still catch thdpack's error, which is also a ValueError with the fix."""
    batch = {key: value for key, value in t3_batch().items() if key != "seq_lens"}
    message = r"batch\['seq_lens'\] is missing or None: thdpack derives cu_seqlens and padding_mask from the pack"
    for convert in (
        process_input_for_thd,
        lambda b: split_batch_into_thd_chunks(b, 2),
        lambda b: make_cp_batch_for_te(_FakeMesh(), b),
        lambda b: make_cp_batch_for_te(_FakeMesh(), b, num_chunks=2),
    ):
        with pytest.raises(KeyError, match=message) as caught:
            convert(batch)
        assert isinstance(caught.value, ValueError) and isinstance(caught.value, NemoKeyError)
        assert str(caught.value).startswith("batch['seq_lens'] is missing")  # not quoted, as KeyError would


def test_outputs_have_nemos_keys_and_no_record():
    out = process_input_for_thd(t3_batch())
    assert "thd_meta" not in out
    assert "thd_meta" not in split_batch_into_thd_chunks(t3_batch(), 2)


def test_cu_seqlens_that_miss_the_token_count_are_named_as_passed(monkeypatch):
    """The error named padding_mask (and then local_index), tensors the caller never passed."""

    class TwoRankMesh:
        def size(self):
            return 2

        def get_group(self):
            return None

    monkeypatch.setattr("thdpack.compat._nemo_thd.dist.get_rank", lambda group=None: 0)
    tokens = {key: torch.arange(8) for key in ("input_ids", "labels", "position_ids")}
    for cu, given in (([0, 4, 12], "cu_seqlens"), ([0, 4, 6], "cu_seqlens")):
        with pytest.raises(ValueError, match=rf"the batch's {given} ends at {cu[-1]} but its input_ids hold 8 tokens"):
            make_cp_batch_for_te(TwoRankMesh(), {**tokens, "cu_seqlens": i32(cu)})
    padded = {**tokens, "cu_seqlens": i32([0, 3, 6]), "cu_seqlens_padded": i32([0, 4, 12])}
    with pytest.raises(ValueError, match=r"the batch's cu_seqlens_padded ends at 12 but its input_ids hold 8"):
        make_cp_batch_for_te(TwoRankMesh(), padded)
    short = {**tokens, "labels": torch.arange(6), "cu_seqlens": i32([0, 4, 8])}
    with pytest.raises(ValueError, match=r"^labels has 6 tokens but the THD layout holds 8"):
        make_cp_batch_for_te(TwoRankMesh(), short)
