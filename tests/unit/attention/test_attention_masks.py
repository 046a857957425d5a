"""Masks from THD metadata: written-out cases, equality with a per-sequence reference, CP shards,
FlexAttention."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given

from thdpack._optional import has_flex_attention
from thdpack.attention.masks import (
    block_causal_bias,
    block_causal_mask,
    flex_block_mask,
    layout_mask,
    mask_to_ascii,
    segment_ids,
    token_layout,
)
from thdpack.cp import partition_indices, shard
from thdpack.thd import collate, thd_collate
from thdpack.thd.tokens import TokenPlacement

from support.thd_cases import C1_SECOND, P1, P5, P6, make_pack, pack_batches


def _reference_mask(thd, causal=True):
    """Per sequence: a (causal) block over its slot, keys restricted to its real tokens."""
    T = int(thd["cu_seqlens_padded"][-1])
    mask = torch.zeros(T, T, dtype=torch.bool)
    cu, cu_padded = thd["cu_seqlens"].tolist(), thd["cu_seqlens_padded"].tolist()
    for i in range(len(cu) - 1):
        start, width, real = cu_padded[i], cu_padded[i + 1] - cu_padded[i], cu[i + 1] - cu[i]
        block = torch.ones(width, width, dtype=torch.bool)
        if causal:
            block = block.tril()
        block[:, real:] = False
        mask[start : start + width, start : start + width] = block
    return mask


def _ascii_rows(mask):
    return mask_to_ascii(mask).split("\n")


def test_spec_block_causal_mask_3_2_1():
    thd = thd_collate([make_pack([[1, 2, 3], [4, 5], [6]], 6)])
    assert _ascii_rows(block_causal_mask(thd)) == ["100000", "110000", "111000", "000100", "000110", "000001"]


def test_spec_block_causal_masks_per_row():
    first = thd_collate([make_pack([[1, 2], [3, 4]], 4)])
    second = thd_collate([make_pack([[1, 2, 3], [4]], 4)])
    assert _ascii_rows(block_causal_mask(first)) == ["1000", "1100", "0010", "0011"]
    assert _ascii_rows(block_causal_mask(second)) == ["1000", "1100", "1110", "0001"]


def test_non_causal_mask_of_p5():
    thd = thd_collate([P5])
    rows = _ascii_rows(block_causal_mask(thd, causal=False))
    assert rows[:4] == ["1110000000000000"] * 4  # padding query 3 sees the 3 real tokens
    assert rows[4:] == ["0000111110000000"] * 12


def test_token_layout_of_p6():
    layout = token_layout(thd_collate([P6]))
    assert layout.seg_T.tolist() == [0] * 4 + [1] * 4 + [2] * 12
    assert layout.pos_T.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, *range(12)]
    assert layout.valid_T.tolist() == [True] * 3 + [False] + [True] * 2 + [False] * 2 + [True] + [False] * 11
    assert layout.seg_T.dtype == layout.pos_T.dtype == torch.int64 and layout.valid_T.dtype == torch.bool


def test_block_causal_bias_values():
    thd = thd_collate([P5])
    bias = block_causal_bias(thd, torch.bfloat16)
    allowed = block_causal_mask(thd)
    assert bias.dtype == torch.bfloat16 and bias.shape == (16, 16)
    assert bool((bias[allowed] == 0).all())
    assert bool((bias[~allowed] == torch.finfo(torch.bfloat16).min).all())
    with pytest.raises(ValueError, match=r"block_causal_bias needs a floating dtype, got torch\.int64"):
        block_causal_bias(thd, torch.int64)


def test_segment_ids_written_out():
    assert segment_ids(collate(P1)).tolist() == [
        [1, 1, 1, 2, 2, 2, 2, 3, 3, 0],
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 0],
    ]
    assert segment_ids(collate([P5, C1_SECOND])).tolist() == [
        [1, 1, 1, 0, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 2, 2, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0],
    ]


def test_token_layout_needs_cu_seqlens():
    with pytest.raises(ValueError, match="token_layout needs cu_seqlens"):
        token_layout({"cu_seqlens_padded": torch.tensor([0, 4], dtype=torch.int32)})
    with pytest.raises(ValueError, match="cu_seqlens has 2 entries but cu_seqlens_padded has 3"):
        token_layout(
            {
                "cu_seqlens": torch.tensor([0, 4], dtype=torch.int32),
                "cu_seqlens_padded": torch.tensor([0, 4, 8], dtype=torch.int32),
            }
        )


def test_token_placement_rejects_mismatched_tensors():
    with pytest.raises(ValueError, match=r"pos_T has shape \(2,\), but the counts describe 3 rows"):
        TokenPlacement((3,), (2,), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"valid_counts \(4,\) must be <= counts \(3,\)"):
        TokenPlacement((3,), (4,))


def test_mask_to_ascii_rejects_1d():
    with pytest.raises(ValueError, match=r"mask_to_ascii takes a 2-D mask, got shape \(3,\)"):
        mask_to_ascii(torch.ones(3, dtype=torch.bool))


@given(pack_batches())
def test_masks_equal_the_per_sequence_reference(case):
    packs, _ = case
    thd = thd_collate(packs)
    for causal in (True, False):
        want = _reference_mask(thd, causal)
        assert torch.equal(block_causal_mask(thd, causal=causal), want)
        assert bool(want.any(1).all())  # no empty row: every sequence has a real first token
    layout = token_layout(thd)
    assert torch.equal(layout.valid_T, ~thd["padding_mask"])
    assert torch.equal(layout.pos_T, thd["position_ids"])
    # segment ids count the sequences of each row from 1, 0 on padding
    seg_BL = layout.seg_T.view(len(packs), -1)
    want_BL = torch.where(layout.valid_T.view_as(seg_BL), seg_BL - seg_BL[:, :1] + 1, 0)
    assert torch.equal(segment_ids(collate(packs)), want_BL)


@given(pack_batches())
def test_shard_masks_are_the_global_mask_restricted(case):
    packs, cp_size = case
    thd = thd_collate(packs)
    global_mask = block_causal_mask(thd)
    global_layout = token_layout(thd)
    T = thd["input_ids"].shape[0]
    for rank in range(cp_size):
        part = shard(thd, cp_size, rank)
        index = partition_indices(thd["cu_seqlens_padded"], T, cp_size, rank).long() if cp_size > 1 else torch.arange(T)
        local = token_layout(part)
        assert torch.equal(local.seg_T, global_layout.seg_T[index])
        # the shard's queries against every key (all-gather CP): rows of the global mask, never empty
        against_all = layout_mask(local, global_layout)
        assert torch.equal(against_all, global_mask[index])
        assert bool(against_all.any(1).all())
        # the shard's queries against its own keys (ring step 0)
        assert torch.equal(block_causal_mask(part), global_mask[index][:, index])


flex = pytest.mark.skipif(not has_flex_attention(), reason="needs torch.nn.attention.flex_attention (torch >= 2.5)")


def _flex_forward(q_BHTD, k_BHTD, v_BHTD, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():  # eager flex is unfused ("called without torch.compile"), fine on CPU
        warnings.filterwarnings("ignore", message=".*without torch.compile", category=UserWarning)
        return flex_attention(q_BHTD, k_BHTD, v_BHTD, block_mask=block_mask)


def _dense_forward(q_BHTD, k_BHTD, v_BHTD, allowed_QK):
    scores = (q_BHTD @ k_BHTD.transpose(-1, -2)) / q_BHTD.shape[-1] ** 0.5
    return scores.masked_fill(~allowed_QK, float("-inf")).softmax(-1) @ v_BHTD


@flex
def test_flex_block_mask_matches_the_dense_mask():
    thd = thd_collate([P6, make_pack([[1] * 17], 20, cp_size=2)])  # T = 40: partial blocks of 16
    for causal in (True, False):
        block_mask = flex_block_mask(thd, causal=causal, block_size=16)
        q_idx, kv_idx = torch.meshgrid(torch.arange(40), torch.arange(40), indexing="ij")
        zero = torch.zeros((), dtype=torch.long)
        assert torch.equal(block_mask.mask_mod(zero, zero, q_idx, kv_idx), block_causal_mask(thd, causal=causal))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 8, dtype=torch.float64) for _ in range(3))
    out = _flex_forward(q, k, v, flex_block_mask(thd, block_size=16))
    torch.testing.assert_close(out, _dense_forward(q, k, v, block_causal_mask(thd)), rtol=1e-10, atol=1e-10)


@flex
def test_flex_block_mask_of_a_shard_against_gathered_keys():
    thd = thd_collate([P6, make_pack([[1] * 17], 20, cp_size=2)])
    part = shard(thd, 2, 1)
    global_layout = token_layout(thd)
    block_mask = flex_block_mask(part, kv_layout=global_layout, block_size=16)
    torch.manual_seed(1)
    k, v = (torch.randn(1, 2, 40, 8, dtype=torch.float64) for _ in range(2))
    q = torch.randn(1, 2, 20, 8, dtype=torch.float64)
    want = _dense_forward(q, k, v, layout_mask(token_layout(part), global_layout))
    torch.testing.assert_close(_flex_forward(q, k, v, block_mask), want, rtol=1e-10, atol=1e-10)


@flex
def test_flex_block_mask_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        flex_block_mask(thd_collate([P5]), block_size=0)


def test_the_mask_rule_truth_table():
    """visible(): same sequence AND real key AND (not causal OR key not after query)."""
    from itertools import product

    from thdpack.attention.masks import visible

    for same, real, after, causal in product((False, True), repeat=4):
        q_seg, k_seg = torch.tensor(0), torch.tensor(0 if same else 1)
        q_pos, k_pos = torch.tensor(3), torch.tensor(4 if after else 2)
        got = bool(visible(q_seg, q_pos, k_seg, k_pos, torch.tensor(real), causal))
        assert got == (same and real and (not causal or not after)), (same, real, after, causal)
