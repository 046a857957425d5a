"""``sdpa`` and ``flex`` (document masks from thdpack.attention.masks) against the ``math`` backend."""

from __future__ import annotations

import pytest
import torch

from thdpack.attention import thd_attention
from thdpack.attention.select import ENV_VAR

from support.attention_cases import make_thd, random_case


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("nq", "nkv"), [(4, 4), (4, 2)])
@pytest.mark.parametrize("multiple", [1, 8])
def test_sdpa_and_flex_forward_match_math(causal, nq, nkv, multiple):
    thd = make_thd([5, 1, 17, 8, 2], multiple=multiple, tail=8 if multiple > 1 else 0)
    case = random_case(thd, nq, nkv, 8, torch.float64, seed=7)
    q, k, v, valid = case["q"], case["k"], case["v"], case["valid"]
    with torch.no_grad():
        want_out, want_lse = thd_attention(q, k, v, thd, causal=causal, backend="math", return_lse=True)
        sdpa_out = thd_attention(q, k, v, thd, causal=causal, backend="sdpa")
        flex_out, flex_lse = thd_attention(q, k, v, thd, causal=causal, backend="flex", return_lse=True)
    assert torch.allclose(sdpa_out[valid], want_out[valid], atol=1e-12, rtol=0)
    assert torch.allclose(flex_out[valid], want_out[valid], atol=1e-12, rtol=0)
    assert flex_lse.shape == want_lse.shape and flex_lse.dtype == torch.float32
    assert torch.allclose(flex_lse[:, valid].double(), want_lse[:, valid], atol=1e-6, rtol=0)  # fp32 LSE
    assert not sdpa_out.isnan().any() and not flex_out.isnan().any()  # padding rows included


def test_sdpa_gradients_match_math():
    thd = make_thd([6, 3, 11], multiple=4)
    case = random_case(thd, 4, 2, 8, torch.float64, seed=8)
    grads = {}
    for backend in ("math", "sdpa"):
        q, k, v = (case[n].clone().requires_grad_() for n in ("q", "k", "v"))
        out = thd_attention(q, k, v, thd, backend=backend)
        grads[backend] = torch.autograd.grad((out * case["dout"]).sum(), (q, k, v))
    for got, want in zip(grads["sdpa"], grads["math"], strict=True):
        assert torch.allclose(got, want, atol=1e-12, rtol=0)


def test_flex_on_cpu_is_refused_when_gradients_are_needed():
    thd = make_thd([4, 4])
    x = torch.randn(8, 2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="backend 'flex' has no backward on CPU"):
        thd_attention(x, x, x, thd, backend="flex")
