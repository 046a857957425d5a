"""collate, to_thd, thd_collate, split_micro_batches, validate_thd: spec vectors, invariants, errors."""

from __future__ import annotations

import multiprocessing as mp
from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import given
from torch.utils.data import DataLoader

from thdpack.thd import collate, split_micro_batches, thd_collate, thd_to_device, to_thd, validate_thd
from thdpack.thd.batch import sequence_lengths

from support.thd_cases import C1_SECOND, P1, P5, P6, make_pack, pack_batches


def _padding_positions(thd):
    return torch.nonzero(thd["padding_mask"]).flatten().tolist()


# ---- the spec's worked examples (nemo_te_spec.md 1.2.5, 1.4, 1.5.3) ----


def test_make_pack_reproduces_spec_p5_and_p6():
    assert P5["input_ids"].tolist() == [1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0]
    assert P5["labels"].tolist() == [1, 2, 3, -100, 4, 5, 6, 7, 8] + [-100] * 7
    assert P5["position_ids"].tolist() == [0, 1, 2, 3, *range(12)]
    assert (P5["seq_lens"].tolist(), P5["seq_lens_padded"].tolist()) == ([3, 5], [4, 12])
    assert P6["input_ids"].tolist() == [1, 2, 3, 0, 4, 5, 0, 0, 6] + [0] * 11
    assert P6["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, *range(12)]
    assert (P6["seq_lens"].tolist(), P6["seq_lens_padded"].tolist()) == ([3, 2, 1], [4, 4, 12])


def test_collate_c1():
    batch = collate([P5, C1_SECOND])
    assert batch["seq_lens"].tolist() == [[3, 5, -1000], [3, 2, 1]]
    assert batch["seq_lens_padded"].tolist() == [[4, 12, -1000], [4, 4, 8]]
    for key in ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded"):
        assert batch[key].dtype == torch.int64
    for key in ("input_ids", "labels", "position_ids"):
        assert batch[key].shape == (2, 16)
    assert batch["input_ids"][1].tolist() == [1, 2, 3, 0, 4, 5, 0, 0, 6] + [0] * 7


def test_collate_c2():
    batch = collate(P1)
    assert batch["seq_lens"].tolist() == [[3, 4, 2], [5, -1000, -1000]]
    assert batch["seq_lens_padded"].tolist() == [[3, 4, 3], [10, -1000, -1000]]
    assert batch["input_ids"].tolist() == [
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 0],
        [10, 11, 12, 13, 14, 0, 0, 0, 0, 0],
    ]


def test_to_thd_t1_two_p1_packs():
    thd = to_thd(collate(P1))
    assert thd["input_ids"].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 10, 11, 12, 13, 14, 0, 0, 0, 0, 0]
    assert thd["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, *range(10)]
    assert thd["cu_seqlens"].tolist() == [0, 3, 7, 9, 14]
    assert thd["cu_seqlens_padded"].tolist() == [0, 3, 7, 10, 20]
    assert thd["cu_seqlens"].dtype == thd["cu_seqlens_padded"].dtype == torch.int32
    assert _padding_positions(thd) == [9, 15, 16, 17, 18, 19]
    assert thd["max_seqlen"] == 10 and type(thd["max_seqlen"]) is int  # widest padded slot, not 5


def test_to_thd_t2_two_cp2_packs():
    thd = to_thd(collate([P5, C1_SECOND]))
    assert thd["cu_seqlens"].tolist() == [0, 3, 8, 11, 13, 14]
    assert thd["cu_seqlens_padded"].tolist() == [0, 4, 16, 20, 24, 32]
    assert _padding_positions(thd) == [3, *range(9, 16), 16 + 3, 16 + 6, 16 + 7, *range(16 + 9, 32)]
    assert thd["max_seqlen"] == 12


def test_to_thd_p6_pack():
    thd = to_thd(collate([P6]))
    assert thd["cu_seqlens"].tolist() == [0, 3, 5, 6]
    assert thd["cu_seqlens_padded"].tolist() == [0, 4, 8, 20]
    assert _padding_positions(thd) == [3, 6, 7, *range(9, 20)]
    assert thd["max_seqlen"] == 12


def test_padding_mask_ignores_token_values_t8():
    eos = 2  # the pad id is also every document's final token (GLM)
    pack = make_pack([[7, 8, eos], [9, 10, eos]], 8, cp_size=2, pad_id=eos)
    assert pack["input_ids"].tolist() == [7, 8, eos, eos, 9, 10, eos, eos]
    thd = to_thd(collate([pack]))
    assert thd["padding_mask"].tolist() == [False, False, False, True, False, False, False, True]


def test_padding_mask_of_a_trailing_pad_t8():
    thd = to_thd(collate([make_pack([[1, 2, 3]], 6)]))
    assert thd["padding_mask"].tolist() == [False, False, False, True, True, True]
    assert thd["cu_seqlens"].tolist() == [0, 3] and thd["cu_seqlens_padded"].tolist() == [0, 6]


# ---- collate: inputs it accepts ----


def test_collate_accepts_lists_and_numpy():
    as_lists = {k: v.tolist() for k, v in P5.items()}
    as_numpy = {k: np.asarray(v) for k, v in P5.items()}
    want = collate([P5, P5])
    for got in (collate([as_lists, as_lists]), collate([as_numpy, P5])):
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key


def test_collate_widens_int32_tokens():
    pack = dict(P5, input_ids=P5["input_ids"].to(torch.int32))
    assert collate([pack])["input_ids"].dtype == torch.int64


def test_extra_per_token_keys_are_stacked_and_flattened():
    loss_mask = (P5["labels"] != -100).to(torch.uint8)
    embeds = torch.randn(16, 3)
    batch = collate([dict(P5, loss_mask=loss_mask, inputs_embeds=embeds)] * 2)
    assert batch["loss_mask"].shape == (2, 16) and batch["loss_mask"].dtype == torch.uint8
    assert batch["inputs_embeds"].shape == (2, 16, 3)
    thd = to_thd(dict(batch, qkv_format="thd"))
    assert torch.equal(thd["loss_mask"], loss_mask.repeat(2))
    assert torch.equal(thd["inputs_embeds"], torch.cat([embeds, embeds]))
    assert thd["qkv_format"] == "thd"
    assert "seq_lens" not in thd and "seq_lens_padded" not in thd
    validate_thd(thd)


def test_thd_collate_equals_to_thd_of_collate():
    packs = [P5, C1_SECOND]
    want, got = to_thd(collate(packs)), thd_collate(packs)
    assert want.keys() == got.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value


@pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="needs the fork start method (POSIX)")
def test_thd_collate_in_dataloader_workers():
    packs = [P5, C1_SECOND, C1_SECOND, P5]
    loader = DataLoader(packs, batch_size=2, collate_fn=thd_collate, num_workers=1, multiprocessing_context="fork")
    batches = list(loader)
    assert [b["cu_seqlens_padded"].tolist() for b in batches] == [
        [0, 4, 16, 20, 24, 32],
        [0, 4, 8, 16, 20, 32],
    ]
    assert all(type(b["max_seqlen"]) is int for b in batches)


def test_thd_to_device_keeps_max_seqlen_an_int():
    thd = thd_to_device(thd_collate([P5]), "meta")
    assert thd["input_ids"].device.type == "meta" and thd["cu_seqlens"].device.type == "meta"
    assert thd["max_seqlen"] == 12 and type(thd["max_seqlen"]) is int


def test_sequence_lengths_drops_the_sentinel():
    real, padded = sequence_lengths(collate([P5, C1_SECOND]))
    assert real.tolist() == [3, 5, 3, 2, 1] and padded.tolist() == [4, 12, 4, 4, 8]


# ---- micro-batches ----


def test_split_micro_batches_equals_collating_the_parts():
    packs = [P5, C1_SECOND, C1_SECOND, P5]
    chunks = split_micro_batches(collate(packs), 2)
    for chunk, part in zip(chunks, (packs[:2], packs[2:]), strict=True):
        want = collate(part)
        assert chunk.keys() == want.keys()
        for key in want:
            assert torch.equal(chunk[key], want[key]), key


def test_split_micro_batches_s4_layout():
    first, second = (to_thd(c) for c in split_micro_batches(collate([P5, C1_SECOND]), 2))
    assert first["cu_seqlens_padded"].tolist() == [0, 4, 16] and first["max_seqlen"] == 12
    assert second["cu_seqlens_padded"].tolist() == [0, 4, 8, 16] and second["max_seqlen"] == 8


def test_split_micro_batches_raises_instead_of_dropping_rows():
    with pytest.raises(ValueError, match=r"B=3 rows, not divisible by num_chunks=2 .*drop 1 rows"):
        split_micro_batches(collate([P5, P5, P5]), 2)
    with pytest.raises(ValueError, match="num_chunks must be an int >= 1, got 0"):
        split_micro_batches(collate([P5]), 0)


# ---- invariants on random packs ----


@given(pack_batches())
def test_thd_invariants(case):
    packs, _ = case
    thd = thd_collate(packs)
    validate_thd(thd)
    T = sum(len(p["input_ids"]) for p in packs)
    assert thd["input_ids"].shape == (T,) and int(thd["cu_seqlens_padded"][-1]) == T
    # padding comes from the layout even though the pad id 0 is also a real token
    assert torch.equal(thd["padding_mask"], thd["is_padding"])
    assert (
        int(thd["cu_seqlens"][-1]) == int((~thd["padding_mask"]).sum()) == sum(int(p["seq_lens"].sum()) for p in packs)
    )
    assert bool((thd["labels"][thd["padding_mask"]] == -100).all())
    real = ~thd["padding_mask"]
    assert torch.equal(thd["labels"][real], 7 * thd["input_ids"][real] + 1)
    cu_padded = thd["cu_seqlens_padded"].tolist()
    for start, end in pairwise(cu_padded):
        assert thd["position_ids"][start:end].tolist() == list(range(end - start))  # positions reset
    assert thd["max_seqlen"] == max(b - a for a, b in pairwise(cu_padded))


# ---- every bad input, with its message ----


@pytest.mark.parametrize(
    ("packs", "error", "message"),
    [
        ([], ValueError, "collate got an empty batch"),
        ({"input_ids": [1]}, TypeError, "collate takes a sequence of packs"),
        ([P5, {k: v for k, v in P5.items() if k != "labels"}], ValueError, r"pack 1 lacks \['labels'\]"),
        ([P5, P6], ValueError, r"pack 1 has input_ids of shape \(20,\) but pack 0 has 16 tokens"),
        ([P5, dict(P5, loss_mask=P5["labels"])], ValueError, r"pack 1 has keys .* but pack 0 has"),
        (
            [dict(P5, seq_lens_padded=torch.tensor([4, 8]))],
            ValueError,
            r"pack 0: seq_lens_padded=\[4, 8\] sums to 12, not the pack length 16",
        ),
        (
            [P5, dict(P5, seq_lens=torch.tensor([3, 13]))],
            ValueError,
            r"pack 1: sequence 1 has 13 real tokens but a padded slot of 12",
        ),
        (
            [dict(P5, seq_lens=torch.tensor([3]))],
            ValueError,
            r"pack 0 has seq_lens \[3\] and seq_lens_padded \[4, 12\]",
        ),
        (
            [dict(P5, seq_lens=torch.tensor([-3, 5]))],
            ValueError,
            "pack 0: sequence 0 has seq_lens=-3, seq_lens_padded=4; lengths must be >= 0",
        ),
        (
            [dict(P5, input_ids=P5["input_ids"].float())],
            TypeError,
            "input_ids must hold integers, got torch.float32",
        ),
        (
            [dict(P5, loss_mask=torch.ones(3))],
            ValueError,
            r"pack 0 has loss_mask of shape \(3,\) but pack 0 has 16 tokens",
        ),
        ([dict(P5, input_ids=[])], ValueError, "pack 0 has 0 tokens"),
        ([dict(P5, labels=object())], TypeError, "pack 0 has labels of type object, not a tensor"),
    ],
)
def test_collate_rejects(packs, error, message):
    with pytest.raises(error, match=message):
        collate(packs)


def _batch(**changes):
    return dict(collate([P5, C1_SECOND]), **changes)


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (
            {"input_ids": torch.zeros(2, 4)},
            r"batch lacks \['labels', 'position_ids', 'seq_lens', 'seq_lens_padded'\]",
        ),
        (_batch(input_ids=torch.zeros(32, dtype=torch.long)), r"input_ids must be a \(B, L\) tensor"),
        (
            _batch(labels=torch.zeros(2, 8, dtype=torch.long)),
            r"labels has shape \(2, 8\); per-token tensors must be \(B, L, ...\) = \(2, 16, ...\)",
        ),
        (
            _batch(seq_lens=torch.tensor([[3, 5], [3, 2]])),
            r"seq_lens has shape \(2, 2\); seq_lens, seq_lens_padded \(and the CP placement.s cp_group_size / "
            r"cp_group_start\) must all be \(B, S\)",
        ),
        (
            _batch(seq_lens=torch.tensor([[3, 5, 1], [3, 2, 1]])),
            r"pack 0: seq_lens\[2\]=1 but seq_lens_padded\[2\]=-1000",
        ),
        (
            _batch(
                seq_lens=torch.tensor([[3, -1000, 5]]),
                seq_lens_padded=torch.tensor([[4, -1000, 12]]),
                input_ids=torch.zeros(1, 16, dtype=torch.long),
                labels=torch.zeros(1, 16, dtype=torch.long),
                position_ids=torch.zeros(1, 16, dtype=torch.long),
            ),
            r"pack 0: seq_lens_padded=\[4, -1000, 12\] has a length after the sentinel -1000",
        ),
    ],
)
def test_to_thd_rejects(batch, message):
    with pytest.raises(ValueError, match=message):
        to_thd(batch)


def test_thd_collate_refuses_a_live_label_on_a_padding_row():
    """Issue 26: a pack edited to seq_lens [3] kept live labels past position 3; thd_collate took it
    and the loss trained on rows attention treats as padding."""
    edited = dict(P5, seq_lens=torch.tensor([3, 2]))  # sequence 1 now holds 2 real tokens of its 5 labelled
    with pytest.raises(
        ValueError,
        match=r"pack 1 has label 6 at position 6, a padding row of its layout \(seq_lens \[3, 2\], seq_lens_padded "
        r"\[4, 12\]\); padding is labelled -100: fix seq_lens, or the labels",
    ):
        thd_collate([P5, edited])
    relabelled = dict(edited, labels=torch.tensor([1, 2, 3, -100, 4, 5] + [-100] * 10))
    assert thd_collate([P5, relabelled])["labels"].shape == (32,)
