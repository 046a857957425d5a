"""LSE merge: partial softmaxes over disjoint key sets combine into the full softmax exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from thdpack.attention.merge import merge_partials, no_lse_gradient, normalize_lse

NEG_INF, POS_INF = float("-inf"), float("inf")


def _attend(q_TNH, k_TNH, v_TNH, keys):
    """Dense attention of all rows over the key subset ``keys``: (out_TNH, lse_NT), fp64."""
    s_NTK = torch.einsum("tnh,knh->ntk", q_TNH, k_TNH[keys])
    lse_NT = torch.logsumexp(s_NTK, -1)
    out_TNH = torch.einsum("ntk,knh->tnh", torch.softmax(s_NTK, -1), v_TNH[keys])
    return out_TNH, lse_NT


@given(seed=st.integers(0, 2**16), parts=st.integers(1, 5), keys=st.integers(1, 24))
def test_merging_random_key_splits_equals_full_softmax(seed, parts, keys):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(6, 2, 4, generator=g, dtype=torch.float64) * 3
    k, v = (torch.randn(keys, 2, 4, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    owner = torch.randint(0, parts, (keys,), generator=g)
    want_out, want_lse = _attend(q, k, v, torch.arange(keys))
    out, lse = torch.zeros_like(want_out), torch.full_like(want_lse, NEG_INF)
    for p in torch.randperm(parts, generator=g).tolist():  # any order: the merge is associative
        members = torch.nonzero(owner == p).flatten()
        if members.numel():
            out, lse = merge_partials(out, lse, *_attend(q, k, v, members))
    assert torch.allclose(out, want_out, atol=1e-12, rtol=0)
    assert torch.allclose(lse, want_lse, atol=1e-12, rtol=0)


def test_empty_rows_merge_without_nan():
    out = torch.tensor([[[5.0]], [[0.0]], [[0.0]]], dtype=torch.float64)  # rows: seen, empty, empty
    lse = torch.tensor([[0.0, NEG_INF, NEG_INF]], dtype=torch.float64)
    part_out = torch.tensor([[[0.0]], [[7.0]], [[0.0]]], dtype=torch.float64)
    part_lse = torch.tensor([[NEG_INF, 1.0, NEG_INF]], dtype=torch.float64)
    merged, merged_lse = merge_partials(out, lse, part_out, part_lse)
    assert merged.flatten().tolist() == [5.0, 7.0, 0.0]
    assert merged_lse.flatten().tolist() == [0.0, 1.0, NEG_INF]


def test_flash_sentinel_is_normalized_before_merging():
    lse = torch.tensor([[POS_INF, 2.0, NEG_INF]])
    assert normalize_lse(lse).tolist() == [[NEG_INF, 2.0, NEG_INF]]
    merged, merged_lse = merge_partials(
        torch.ones(3, 1, 1), torch.zeros(1, 3), torch.zeros(3, 1, 1), normalize_lse(lse)
    )
    assert not merged.isnan().any() and not merged_lse.isnan().any()
    assert merged[0].item() == 1.0  # the sentinel row contributes nothing


def test_merge_accumulates_in_the_accumulator_dtype():
    out = torch.zeros(2, 1, 3, dtype=torch.float32)
    lse = torch.full((1, 2), NEG_INF)
    merged, merged_lse = merge_partials(out, lse, torch.ones(2, 1, 3, dtype=torch.bfloat16), torch.zeros(1, 2))
    assert merged.dtype == torch.float32 and merged_lse.dtype == torch.float32
    assert merged.eq(1).all()


def test_lse_gradient_guard_raises_only_for_a_nonzero_gradient():
    source = torch.zeros(2, 3, requires_grad=True)
    guarded = no_lse_gradient(source * 1.0, "a test kernel")
    (guarded * 0).sum().backward()  # a zero gradient is harmless
    with pytest.raises(RuntimeError, match="LSE returned by a test kernel, whose kernel ignores"):
        no_lse_gradient(source * 1.0, "a test kernel").sum().backward()
