"""The Hugging Face adapter without transformers: the kwargs of a model call, the attention
function (called the way transformers calls it), and the registration's missing-package error."""

from __future__ import annotations

import sys

import pytest
import torch

from thdpack.attention import thd_attention
from thdpack.cp import shard
from thdpack.models.hf.attention import (
    CP_GROUP_KWARG,
    THD_KWARG,
    hf_attention_forward,
    hf_packed_kwargs,
    register_hf_attention,
)
from thdpack.thd import to_thd


def _thd(cp_multiple: int = 1) -> dict:
    """Sequences of 3 and 2 tokens, slots of 4 and 4 (+4 tail padding when cp_multiple is 4)."""
    tail = [0] * 4 if cp_multiple == 4 else []
    return to_thd(
        {
            "input_ids": torch.tensor([[5, 6, 7, 0, 8, 9, 0, 0, *tail]]),
            "labels": torch.tensor([[6, 7, -100, -100, 9, -100, -100, -100, *[-100] * len(tail)]]),
            "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, *range(4, 4 + len(tail))]]),
            "seq_lens": torch.tensor([[3, 2]]),
            "seq_lens_padded": torch.tensor([[4, 4 + len(tail)]]),
        }
    )


def test_kwargs_of_an_unsharded_batch():
    thd = _thd()
    kwargs = hf_packed_kwargs(thd)
    assert set(kwargs) == {
        "input_ids",
        "position_ids",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "use_cache",
        THD_KWARG,
    }
    assert kwargs["use_cache"] is False  # with a cache, transformers' sdpa / eager attend across the row
    assert kwargs["input_ids"].tolist() == [[5, 6, 7, 0, 8, 9, 0, 0]]
    assert kwargs["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["cu_seq_lens_q"].tolist() == kwargs["cu_seq_lens_k"].tolist() == [0, 4, 8]
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 4
    assert kwargs[THD_KWARG]["cu_seqlens"].tolist() == [0, 3, 5]


def test_labels_are_given_pre_shifted():
    kwargs = hf_packed_kwargs(_thd(), include_labels=True)
    want = [[6, 7, -100, -100, 9, -100, -100, -100]]
    assert kwargs["labels"].tolist() == kwargs["shift_labels"].tolist() == want


class _Model(torch.nn.Module):
    """What check_hf_attention reads of a transformers model: ``config._attn_implementation``."""

    def __init__(self, implementation):
        super().__init__()
        self.config = type("Config", (), {"_attn_implementation": implementation})()


def test_a_cp_shard_carries_the_group_and_no_flash_kwargs(monkeypatch):
    import thdpack.models.hf.attention as hf

    monkeypatch.setattr(hf, "_REGISTERED", {"thdpack"})
    group = object()  # stands in for a ProcessGroup: the kwargs only carry it
    local = shard(_thd(cp_multiple=4), 2, 1)
    kwargs = hf_packed_kwargs(local, cp_group=group, model=_Model("thdpack"))  # type: ignore[arg-type]
    assert kwargs[CP_GROUP_KWARG] is group
    assert "cu_seq_lens_q" not in kwargs
    assert kwargs["input_ids"].shape == (1, 6)
    assert kwargs["position_ids"].tolist() == [[1, 2, 2, 3, 4, 5]]  # chunks 1 and 2: global positions
    assert kwargs[THD_KWARG]["thd_meta"].cp_rank == 1  # the shard's record travels to the attention


def test_kwargs_need_labels_to_include_them():
    thd = _thd()
    del thd["labels"]
    with pytest.raises(ValueError, match=r"the THD batch lacks \['labels'\]"):
        hf_packed_kwargs(thd, include_labels=True)


@pytest.mark.parametrize(
    ("sharded", "group_size", "match"),
    [
        (True, None, "the THD batch is CP rank 0's shard of cp_size=2 but no cp_group was given"),
        (False, 2, "the THD batch is not CP-sharded but this process is rank 0 of a cp_group of 2"),
    ],
)
def test_the_attention_checks_the_group_against_the_shard(monkeypatch, sharded, group_size, match):
    """hf_packed_kwargs carries the group; thdpack's attention checks it, with ThdMeta's one message."""
    import thdpack.models.hf.attention as hf

    monkeypatch.setattr(hf, "_REGISTERED", {"thdpack"})
    group = None if group_size is None else object()  # stands in for a ProcessGroup of group_size ranks
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda g: group_size)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda g: 0)
    thd = shard(_thd(cp_multiple=4), 2, 0) if sharded else _thd(cp_multiple=4)
    kwargs = hf_packed_kwargs(thd, cp_group=group, model=_Model("thdpack"))  # type: ignore[arg-type]
    query = torch.zeros(1, 2, thd["input_ids"].shape[0], 8)
    with pytest.raises(ValueError, match=match):
        hf_attention_forward(_Layer(), query, query[:, :1], query[:, :1], None, **kwargs)


class _Layer(torch.nn.Module):
    is_causal = True


def _bhtd(seed: int, heads: int, tokens: int = 8) -> torch.Tensor:
    return torch.randn(1, heads, tokens, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("route", ["thdpack kwargs", "flash kwargs only"])
def test_attention_function_equals_thd_attention(route):
    thd = _thd()
    kwargs = hf_packed_kwargs(thd)
    if route == "flash kwargs only":
        del kwargs[THD_KWARG]
    q, k, v = _bhtd(0, 4), _bhtd(1, 2), _bhtd(2, 2)
    out, weights = hf_attention_forward(_Layer(), q, k, v, None, scaling=0.3, **kwargs)
    assert weights is None
    assert out.shape == (1, 8, 4, 8)  # (B, T, heads, head_dim), as transformers expects
    want = thd_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), thd, softmax_scale=0.3)
    real = ~thd["padding_mask"]
    torch.testing.assert_close(out[0][real], want[real], rtol=0, atol=1e-12)


def test_attention_function_under_autocast_computes_in_the_autocast_dtype():
    """Under autocast RoPE leaves q and k in float32 while v comes out of the bf16 projection;
    like sdpa, the attention runs in bf16 (before: "q, k, v must share one dtype")."""
    kwargs = hf_packed_kwargs(_thd())
    q, k, v = (_bhtd(seed, 2).float() for seed in (0, 1, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = hf_attention_forward(_Layer(), q, k, v.bfloat16(), None, **kwargs)
    want, _ = hf_attention_forward(_Layer(), q, k, v, None, **kwargs)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, rtol=0, atol=0.05)


def test_attention_function_honours_is_causal():
    kwargs = hf_packed_kwargs(_thd())
    q, k, v = _bhtd(0, 2), _bhtd(1, 2), _bhtd(2, 2)
    causal, _ = hf_attention_forward(_Layer(), q, k, v, None, **kwargs)
    bidirectional, _ = hf_attention_forward(_Layer(), q, k, v, None, is_causal=False, **kwargs)
    assert (causal[0, 0] - bidirectional[0, 0]).abs().max() > 1e-3  # token 0 sees tokens 1, 2 only when bidirectional


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (
            {"attention_mask": torch.ones(1, 1, 8, 8)},
            r"got an attention_mask of shape \(1, 1, 8, 8\); packed rows need none",
        ),
        ({"dropout": 0.1}, r"thdpack attention has no dropout, got dropout=0.1"),
        (
            {"sliding_window": 2},
            r"config.sliding_window=2 is shorter than sequence 0 of the batch \(3 tokens\): thdpack attention has no "
            r"sliding window",
        ),
        (
            {"softcap": 30.0},
            r"softcaps its attention scores \(config.attn_logit_softcapping=30.0\) and thdpack attention cannot",
        ),
        (
            {"drop kwargs": True},
            r"thdpack attention needs the packing metadata: call the model with \*\*hf_packed_kwargs",
        ),
    ],
)
def test_attention_function_errors(extra, match):
    kwargs = {} if extra.pop("drop kwargs", False) else hf_packed_kwargs(_thd())
    mask = extra.pop("attention_mask", None)
    q = _bhtd(0, 2)
    with pytest.raises(ValueError, match=match):
        hf_attention_forward(_Layer(), q, q, q, mask, **extra, **kwargs)


@pytest.mark.parametrize("window", [3, 4, 100])
def test_a_window_no_sequence_outgrows_changes_nothing(window):
    """Sequences of 3 and 2 tokens in slots of 4: a window of 3 or more never binds."""
    thd = _thd()
    q, k, v = _bhtd(0, 2), _bhtd(1, 2), _bhtd(2, 2)
    out, _ = hf_attention_forward(_Layer(), q, k, v, None, sliding_window=window, **hf_packed_kwargs(thd))
    want = thd_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), thd)
    real = ~thd["padding_mask"]
    torch.testing.assert_close(out[0][real], want[real], rtol=0, atol=1e-12)


def test_attention_function_rejects_a_batch_of_rows():
    with pytest.raises(
        ValueError, match=r"takes one packed row, query \(1, heads, T, head_dim\); got shape \(2, 2, 8, 8\)"
    ):
        q = torch.zeros(2, 2, 8, 8, dtype=torch.float64)
        hf_attention_forward(_Layer(), q, q, q, None, **hf_packed_kwargs(_thd()))


def test_registration_without_transformers_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails, as when absent
    with pytest.raises(ImportError, match=r"register_hf_attention needs 'transformers', which is not installed"):
        register_hf_attention()


def test_registration_with_transformers():
    import transformers

    name = register_hf_attention("thdpack_test")
    assert transformers.AttentionInterface._global_mapping[name] is hf_attention_forward


@pytest.mark.parametrize(
    ("implementation", "sharded", "message"),
    [
        ("sdpa", True, r"the model's attention 'sdpa' cannot run a CP shard: each rank holds only chunks"),
        ("flash_attention_2", True, r"'flash_attention_2' cannot run a CP shard"),
        ("paged|sdpa", False, r"'paged\|sdpa' is not known to be exact on a packed row"),
        (None, True, "pass model= with a CP shard"),
    ],
)
def test_attention_that_cannot_be_exact_is_refused(monkeypatch, implementation, sharded, message):
    import thdpack.models.hf.attention as hf

    monkeypatch.setattr(hf, "_REGISTERED", {"thdpack"})
    thd = shard(_thd(cp_multiple=4), 2, 0) if sharded else _thd()
    model = None if implementation is None else _Model(implementation)
    with pytest.raises(ValueError, match=message):
        hf_packed_kwargs(thd, cp_group=object() if sharded else None, model=model)  # type: ignore[arg-type]
    for fine in ("sdpa", "eager", "flex_attention", "flash_attention_2", "thdpack"):
        hf_packed_kwargs(_thd(), model=_Model(fine))  # unsharded: exact with these
