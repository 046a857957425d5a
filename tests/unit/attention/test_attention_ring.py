"""The ring algorithm in one process (ranks as threads): exact against the oracle, for any layout.

The multi-process runs are in tests/distributed/test_cp_attention.py; these cover many more length
mixes cheaply, the tile schedule, gradcheck through the ring and a mutation check.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thdpack.attention import ring
from thdpack.attention.ring_simulation import simulated_ring_attention

from support.attention_cases import (
    LENGTH_MIXES,
    autograd_results,
    global_errors,
    make_thd,
    random_case,
    reference_results,
)


def _ring(thd, cp_size, causal):
    def attend(q, k, v):
        return simulated_ring_attention(q, k, v, thd, cp_size=cp_size, causal=causal)

    return attend


def test_tile_schedule_is_transformer_engines():
    # by KV source rank (nemo_te_spec.md 2.5): src == r diagonal, src < r lower (front kv), src > r upper
    expected = {"d": ("all", "all", True), "l": ("all", "front", False), "u": ("back", "all", False)}
    table = ["duuu", "lduu", "lldu", "llld"]  # rows: rank; columns: source rank of the K/V block
    for rank, row in enumerate(table):
        for step in range(4):
            src = (rank - step) % 4
            assert ring.tile_sections(step, rank, True) == expected[row[src]], (rank, step)
            assert ring.tile_sections(step, rank, False) == ("all", "all", False)


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("mix", sorted(LENGTH_MIXES))
def test_ring_matches_reference(cp_size, mix):
    lengths = LENGTH_MIXES[mix](2 * cp_size)
    for causal, (nq, nkv), tail in ((True, (4, 2), 0), (False, (4, 4), 2 * cp_size)):
        thd = make_thd(lengths, cp_size, tail=tail)
        case = random_case(thd, nq, nkv, 8, torch.float64, seed=cp_size)
        got = autograd_results(case, _ring(thd, cp_size, causal))
        errors = global_errors(got, reference_results(case, thd, causal), case["valid"])
        assert max(errors.values()) <= 1e-10, (mix, causal, errors)


@settings(max_examples=25)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=5),
    cp_size=st.integers(2, 4),
    causal=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_ring_matches_reference_for_any_lengths(lengths, cp_size, causal, seed):
    thd = make_thd(lengths, cp_size)
    case = random_case(thd, 2, 1, 4, torch.float64, seed)
    got = autograd_results(case, _ring(thd, cp_size, causal))
    errors = global_errors(got, reference_results(case, thd, causal), case["valid"])
    assert max(errors.values()) <= 1e-10, errors


def test_ring_fp32_within_1e5():
    thd = make_thd([40, 3, 17, 64], 4)
    case = random_case(thd, 4, 2, 16, torch.float32, seed=9)
    for causal in (True, False):
        got = autograd_results(case, _ring(thd, 4, causal))
        errors = global_errors(got, reference_results(case, thd, causal), case["valid"])
        assert max(errors.values()) <= 1e-5, errors
        assert got["out"].dtype == torch.float32 and got["lse"].dtype == torch.float32


def test_padded_keys_get_no_gradient():
    thd = make_thd([1, 5], 2, tail=4)
    case = random_case(thd, 2, 2, 4, torch.float64, seed=4)
    padding = ~case["valid"]
    for causal in (True, False):
        got = autograd_results(case, _ring(thd, 2, causal))
        assert got["dk"][padding].eq(0).all() and got["dv"][padding].eq(0).all()
        assert got["dk"][~padding].abs().sum() > 0


_RIGHT_SECTIONS = ring.tile_sections


def _wrong_upper_sections(step, rank, causal):
    q_rows, kv_rows, tile_causal = _RIGHT_SECTIONS(step, rank, causal)
    return ("all", "front", False) if (q_rows, kv_rows) == ("back", "all") else (q_rows, kv_rows, tile_causal)


def test_a_wrong_tile_schedule_is_detected(monkeypatch):
    thd = make_thd([16, 9, 24], 2)
    case = random_case(thd, 2, 2, 8, torch.float64, seed=1)
    want = reference_results(case, thd, True)
    monkeypatch.setattr(ring, "tile_sections", _wrong_upper_sections)
    errors = global_errors(autograd_results(case, _ring(thd, 2, True)), want, case["valid"])
    assert errors["out"] > 1e-2, errors  # the check discriminates


@pytest.mark.parametrize("cp_size", [2, 3])
def test_gradcheck_through_a_simulated_ring(cp_size):
    thd = make_thd([2 * cp_size, 3], cp_size)  # second sequence padded
    total = int(thd["cu_seqlens_padded"][-1])
    g = torch.Generator().manual_seed(cp_size)
    q = torch.randn(total, 2, 3, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(total, 1, 3, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(total, 1, 3, dtype=torch.float64, generator=g, requires_grad=True)
    for causal in (True, False):
        assert torch.autograd.gradcheck(_ring(thd, cp_size, causal), (q, k, v), fast_mode=True)


def test_the_global_tensors_are_required():
    thd = make_thd([8], 2)
    x = torch.randn(4, 1, 2)
    with pytest.raises(
        ValueError,
        match=r"q \(the global batch's, as simulated_ring_attention takes\) has 4 tokens but the THD layout holds 8",
    ):
        simulated_ring_attention(x, x, x, thd, cp_size=2)
