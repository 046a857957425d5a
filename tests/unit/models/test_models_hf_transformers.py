"""Real transformers models (tiny random configs, fp64, no download) on packed rows without CP: the
logits, the loss and every gradient of a packed row equal every sequence run alone (1e-10), with
Hugging Face's own attention and with thdpack's; what cannot be exact is refused, naming why.
The CP counterpart: tests/distributed/test_models_hf_distributed.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from thdpack.cp import shard
from thdpack.models.hf.attention import hf_packed_kwargs, register_hf_attention

from support.hf_cases import (
    ARCHITECTURES,
    differences,
    hf_model,
    keep_float64,
    packed_row,
    packed_step,
    samples,
    unpacked_step,
)

TOL = 1e-10
IMPLEMENTATIONS = ["eager", "sdpa", "thdpack"]


def _name(implementation: str) -> str:
    return register_hf_attention() if implementation == "thdpack" else implementation


@pytest.fixture(scope="module")
def references() -> dict:
    """Per architecture: every sample alone through plain eager transformers (the oracle)."""
    return {arch: unpacked_step(hf_model(arch, "eager"), samples()) for arch in ARCHITECTURES}


def _worst_cross_talk(model, reference, *, use_cache: bool | None = None, exact: bool = True) -> float:
    """Max |packed - alone| of the logits over the real tokens of every sequence of the row."""
    thd = packed_row(samples())
    kwargs = hf_packed_kwargs(thd, model=model)
    if use_cache is not None:
        kwargs["use_cache"] = use_cache
    starts, lengths = thd["cu_seqlens_padded"][:-1].tolist(), torch.diff(thd["cu_seqlens"]).tolist()
    worst = 0.0
    with torch.no_grad(), keep_float64() if exact else contextlib.nullcontext():
        packed_TV = model(**kwargs).logits[0]
        for start, n in zip(starts, lengths, strict=True):
            alone_TV = reference(input_ids=thd["input_ids"][start : start + n][None], use_cache=False).logits[0]
            worst = max(worst, float((packed_TV[start : start + n] - alone_TV).abs().max()))
    return worst


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_no_sequence_attends_to_another(arch, implementation):
    # attention across sequences moves logits by 0.1-0.4 here; measured: at most 2e-16
    assert _worst_cross_talk(hf_model(arch, _name(implementation)), hf_model(arch, "eager")) <= TOL


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_packed_loss_and_every_gradient_equal_unpacked(references, arch, implementation):
    """transformers' own loss on the row (pre-shifted labels, num_items_in_batch = loss tokens)
    vs the sum of every sequence's token losses alone / their count. Measured: 9e-16, 4e-17."""
    result = packed_step(hf_model(arch, _name(implementation)), packed_row(samples()))
    errors = differences(result, references[arch])
    assert max(errors.values()) <= TOL, errors
    assert max(float(g.abs().max()) for g in result.grads.values()) > 1e-2  # gradients that could differ


def test_the_check_can_fail_a_cache_lets_sequences_attend_to_each_other():
    """The reported bug: with transformers' default use_cache=True, sdpa sees the whole row."""
    assert _worst_cross_talk(hf_model("Llama", "sdpa"), hf_model("Llama", "eager"), use_cache=True) > 1e-3


def test_float64_models_compute_in_float32_inside_transformers_unless_kept():
    """The residual the old test tolerated (4e-8 on logits with eager): transformers' float32
    steps (here eager's float32 softmax over rows of different lengths, and RMSNorm). Inside
    ``keep_float64`` they are float64; casts outside transformers' code are left alone."""
    model = hf_model("Llama", "eager")
    assert _worst_cross_talk(model, model, exact=False) > 1e-9
    assert _worst_cross_talk(model, model) <= TOL
    x = torch.randn(3, 32, dtype=torch.float64)
    norm = model.model.norm
    with torch.no_grad():
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight
        with keep_float64():
            assert float((norm(x) - want).abs().max()) <= 1e-15
            assert x.float().dtype == torch.float32  # this file's own cast is not transformers'
        assert float((norm(x) - want).abs().max()) > 1e-10


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_hugging_face_attention_is_refused_on_a_cp_shard(arch):
    local = shard(packed_row(samples(), cp_size=2), 2, 0)
    model = hf_model(arch, "eager")
    for implementation in ("eager", "sdpa", "flex_attention", "flash_attention_2"):
        model.config._attn_implementation = implementation  # set after __init__: flash_attn is not installed here
        with pytest.raises(ValueError, match=rf"the model's attention '{implementation}' cannot run a CP shard"):
            hf_packed_kwargs(local, cp_group=object(), model=model)  # type: ignore[arg-type]
    hf_packed_kwargs(local, cp_group=object(), model=hf_model(arch, register_hf_attention()))  # type: ignore[arg-type]


# sliding windows and softcapping: transformers' own attention applies them on a packed row;
# thdpack's attention has neither and refuses them, naming the config field
WINDOWED = {
    "Mistral window 4": ("Mistral", {"sliding_window": 4}),
    "Gemma2 window 4, softcaps": ("Gemma2", {"sliding_window": 4, "head_dim": 8}),
}


@pytest.mark.parametrize("case", sorted(WINDOWED))
def test_sliding_windows_and_softcapping_are_exact_with_transformers_attention(case):
    arch, extra = WINDOWED[case]
    reference = unpacked_step(hf_model(arch, "eager", **extra), samples())
    for implementation in ("eager", "sdpa") if arch == "Mistral" else ("eager",):  # sdpa refuses a softcap
        errors = differences(packed_step(hf_model(arch, implementation, **extra), packed_row(samples())), reference)
        assert max(errors.values()) <= TOL, (implementation, errors)


def test_a_window_of_the_model_changes_the_result():
    """Why a window thdpack's attention ignored would be wrong: 4 vs no window, sequences up to 13."""
    errors = differences(
        unpacked_step(hf_model("Mistral", "eager", sliding_window=4), samples()),
        unpacked_step(hf_model("Mistral", "eager", sliding_window=None), samples()),
    )
    assert errors["loss"] > 1e-4


@pytest.mark.parametrize(
    ("arch", "extra", "message"),
    [
        (
            "Mistral",
            {"sliding_window": 4},
            r"config.sliding_window=4 is shorter than sequence 0 of the batch \(13 tokens\): thdpack attention has no "
            r"sliding window",
        ),
        (
            "Gemma2",
            {"head_dim": 8},
            r"softcaps its attention scores \(config.attn_logit_softcapping=50.0\) and thdpack attention cannot",
        ),
        ("Gemma2", {"head_dim": 8, "attn_logit_softcapping": None, "sliding_window": 12}, r"config.sliding_window=12"),
        (
            "Qwen2",
            {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
            r"config.sliding_window=4 is shorter than sequence 0",
        ),
        ("Llama", {"layer_types": ["full_attention", "chunked_attention"]}, r"config.layer_types has \['chunked_"),
    ],
)
@pytest.mark.parametrize("cp_size", [1, 2])
def test_what_thdpack_attention_cannot_do_is_refused(arch, extra, message, cp_size):
    """Up front in hf_packed_kwargs(model=...), on a row and on a CP shard; and per layer call
    where the layer passes its window or softcap (a Llama layer does not know it is chunked)."""
    model = hf_model(arch, register_hf_attention(), **extra)
    thd = packed_row(samples(), cp_size=cp_size)
    with pytest.raises(ValueError, match=message):
        if cp_size == 1:
            hf_packed_kwargs(thd, model=model)
        else:
            hf_packed_kwargs(shard(thd, 2, 1), cp_group=object(), model=model)  # type: ignore[arg-type]
    if "layer_types" not in extra:
        with pytest.raises(ValueError, match=message):
            model(**hf_packed_kwargs(thd))


@pytest.mark.parametrize("window", [13, 4096])
def test_a_window_no_sequence_outgrows_is_exact_with_thdpack_attention(window):
    """Mistral v0.1's window of 4096 over short sequences, and one exactly the longest (13)."""
    reference = unpacked_step(hf_model("Mistral", "eager", sliding_window=window), samples())
    model = hf_model("Mistral", register_hf_attention(), sliding_window=window)
    errors = differences(packed_step(model, packed_row(samples())), reference)
    assert max(errors.values()) <= TOL, errors


def test_flex_attention_is_refused_for_a_float64_cpu_model():
    """torch compiles CPU FlexAttention for float32 / float16 / bfloat16 only: refused up front
    instead of an InductorError after seconds of compiling."""
    model = hf_model("Llama", "flex_attention")
    with pytest.raises(ValueError, match=r"flex_attention cannot run a float64 model on the CPU"):
        hf_packed_kwargs(packed_row(samples()), model=model)


@pytest.mark.slow
def test_flex_attention_is_exact_on_a_float32_row():
    """No sequence attends to another through flex's BlockMask (compiled: about 15 s on the CPU).
    float32, so exact means float32 rounding: measured 1.2e-7; cross-talk would be 5e-2 or more."""
    flex, eager = hf_model("Llama", "flex_attention").float(), hf_model("Llama", "eager").float()
    thd = packed_row(samples())
    starts, lengths = thd["cu_seqlens_padded"][:-1].tolist(), torch.diff(thd["cu_seqlens"]).tolist()
    with torch.no_grad():
        packed_TV = flex(**hf_packed_kwargs(thd, model=flex)).logits[0]
        for start, n in zip(starts, lengths, strict=True):
            alone_TV = eager(input_ids=thd["input_ids"][start : start + n][None], use_cache=False).logits[0]
            assert float((packed_TV[start : start + n] - alone_TV).abs().max()) <= 1e-5
