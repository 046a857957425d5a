"""Transformer Engine's backend rules, predicted on the CPU (no TE needed): each row is a call TE
would attend, or refuse with "No dot product attention backend is available", by the filters of
``get_attention_backend`` (``transformer_engine/pytorch/attention/dot_product_attention/utils.py``,
tags v2.5 to v2.18 and main) and the assertions of its CP functions (``context_parallel.py``).

Then the selection: ``auto`` falls back from ``te`` to thdpack's ring when TE would find no backend,
and ``backend="te"`` refuses naming TE's reasons.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from thdpack import _optional
from thdpack.attention import select
from thdpack.attention.backends.base import CallFacts
from thdpack.attention.backends.te import te_facts
from thdpack.attention.backends.te_rules import TEFacts, te_problem
from thdpack.attention.select import choose_backend, log_choice

CP_PADDED = TEFacts(
    version=(2, 18, 0),
    capability=(9, 0),
    cudnn=(9, 10, 0),
    flash_attn_2=True,
    flash_attn_3=False,
    pad_between_seqs=True,
    cp=True,
    cp_comm_type="p2p",
    num_heads=8,
    num_gqa_groups=2,
    head_dim_qk=128,
    head_dim_v=128,
)
"""An H100 under CP with padded slots (nearly every CP batch): only cuDNN's FusedAttention applies."""
NO_BACKEND = "has no attention backend for this call"


def facts(**changes) -> TEFacts:
    return dataclasses.replace(CP_PADDED, **changes)


RULES = [
    # (case, facts, None: a backend is left | text of the refusal)
    ("h100 cp padded: cuDNN", facts(), None),
    ("a100 cp padded: cuDNN", facts(capability=(8, 0)), None),
    ("cp unpadded: FlashAttention 2 too", facts(pad_between_seqs=False, cudnn=(8, 0, 0)), None),
    # pad_between_seqs drops FA2 and the unfused path (utils.py "Filter: QKV layout"), CP drops unfused
    (
        "deterministic training below sm90",
        facts(capability=(8, 0), deterministic=True),
        "FlashAttention 2: not with padding between sequences (pad_between_seqs); FlashAttention 3: sm90 only; "
        "FusedAttention: deterministic training below sm90; unfused: no context parallelism",
    ),
    ("deterministic on sm90: cuDNN", facts(deterministic=True), None),
    (
        "deterministic below sm90 without padding: FA2",
        facts(capability=(8, 0), deterministic=True, pad_between_seqs=False),
        None,
    ),
    # sm120 with THD: cuDNN >= 9.18.1 from TE 2.14; never in TE 2.9 to 2.13
    (
        "sm120, cuDNN 9.10",
        facts(capability=(12, 0)),
        "FusedAttention: THD on sm120 needs cuDNN >= 9.18.1, found 9.10.0",
    ),
    ("sm120, cuDNN 9.18.1", facts(capability=(12, 0), cudnn=(9, 18, 1)), None),
    ("sm120, TE 2.12", facts(capability=(12, 0), cudnn=(9, 18, 1), version=(2, 12)), "THD is not supported on sm120"),
    ("sm120, TE 2.12, no cp: unfused", facts(capability=(12, 0), version=(2, 12), cp=False), None),
    ("sm120, TE 2.16, no cp", facts(capability=(12, 0), version=(2, 16), cp=False), "unfused: not with padding"),
    (
        "sm120, TE 2.10, no cp, no padding, no FA2",
        facts(capability=(12, 0), version=(2, 10), cp=False, pad_between_seqs=False, flash_attn_2=False),
        "unfused: no THD before TE 2.11",
    ),
    # TE's all-to-all: FusedAttention needs even head counts (TE 2.15+); FA3 takes padding from TE 2.16
    (
        "a2a, odd heads",
        facts(cp_comm_type="a2a", num_heads=9, num_gqa_groups=3),
        "FusedAttention: cp_comm_type='a2a' needs even head counts, got 9 / 3",
    ),
    ("a2a, odd heads, FA3", facts(cp_comm_type="a2a", num_heads=9, num_gqa_groups=3, flash_attn_3=True), None),
    (
        "a2a, odd heads, FA3, TE 2.15",
        facts(cp_comm_type="a2a", num_heads=9, num_gqa_groups=3, flash_attn_3=True, version=(2, 15)),
        "FlashAttention 3: not with padding between sequences before TE 2.16",
    ),
    ("a2a, even heads", facts(cp_comm_type="a2a"), None),
    # FP8 attention: no FlashAttention in training, no unfused, and no cuDNN with THD under CP (after 2.18)
    ("fp8, TE 2.18", facts(fp8_attention=True), None),
    (
        "fp8, TE 2.20",
        facts(fp8_attention=True, version=(2, 20)),
        "FusedAttention: no context parallelism with FP8 attention and THD",
    ),
    ("fp8, TE 2.20, no cp", facts(fp8_attention=True, version=(2, 20), cp=False), None),
    # FlashAttention 3: sm90; head dims by _is_fa3_supported (TE 2.8+), <= 128 before
    ("fa3 on sm90, sm120 cuDNN old", facts(flash_attn_3=True, flash_attn_2=False, version=(2, 17)), None),
    (
        "fa3 head dim 192/128 (MLA), TE 2.8",
        facts(capability=(12, 0), flash_attn_3=True, head_dim_qk=192, head_dim_v=128),
        "FlashAttention 3: sm90 only",
    ),
    # TE's CP functions assert head_dim % 8 == 0: the ring before 2.8, all-gather and all-to-all before 2.15
    (
        "a2a head dim 36, TE 2.14",
        facts(cp_comm_type="a2a", head_dim_qk=36, head_dim_v=36, version=(2, 14)),
        "context parallelism (cp_comm_type='a2a') asserts head_dim % 8 == 0, and the head dim is 36",
    ),
    ("a2a head dim 36, TE 2.15", facts(cp_comm_type="a2a", head_dim_qk=36, head_dim_v=36, version=(2, 15)), None),
    (
        "all_gather head dim 36, TE 2.14",
        facts(cp_comm_type="all_gather", head_dim_qk=36, head_dim_v=36, version=(2, 14)),
        "asserts head_dim % 8 == 0",
    ),
    ("p2p head dim 36, TE 2.7", facts(head_dim_qk=36, head_dim_v=36, version=(2, 7)), "asserts head_dim % 8 == 0"),
    ("p2p head dim 36, TE 2.8", facts(head_dim_qk=36, head_dim_v=36, version=(2, 8)), None),
    # FlashAttention 2's head dims, on an unpadded batch where cuDNN is out (sm120, old cuDNN)
    (
        "fa2 head dim 36",
        facts(capability=(12, 0), pad_between_seqs=False, head_dim_qk=36, head_dim_v=36),
        "FlashAttention 2: head dim 36 (a multiple of 8, <= 256; > 192 only on sm80/90/100/120)",
    ),
    (
        "fa2 head dim 256 on sm120",
        facts(capability=(12, 0), pad_between_seqs=False, head_dim_qk=256, head_dim_v=256),
        None,
    ),
    ("below sm80", facts(capability=(7, 5), pad_between_seqs=False), "FusedAttention: needs sm80+"),
]


@pytest.mark.parametrize(("case", "given", "refusal"), RULES, ids=[row[0] for row in RULES])
def test_transformer_engines_rules(case, given, refusal):
    said = te_problem(given)
    if refusal is None:
        assert said is None, said
    else:
        assert said is not None and refusal in said, said


def test_a_refusal_names_the_version_the_situation_and_every_backend():
    said = te_problem(facts(capability=(12, 0)))
    assert said == (
        "Transformer Engine 2.18.0 has no attention backend for this call (sm120, context parallel p2p, padding "
        "between sequences): FlashAttention 2: not with padding between sequences (pad_between_seqs); "
        "FlashAttention 3: sm90 only; FusedAttention: THD on sm120 needs cuDNN >= 9.18.1, found 9.10.0; "
        "unfused: no context parallelism"
    )


# --- the selection: a CallFacts of thd_attention, a faked Transformer Engine -------------------------

CUDA = torch.device("cuda")


def situation(*, comm="p2p", heads=(8, 2), cp_size=2, padded=True, sm=(12, 0), head_dim=64) -> CallFacts:
    return CallFacts(
        device=CUDA,
        dtype=torch.bfloat16,
        cp=cp_size > 1,
        cp_comm_type=comm,
        need_lse=False,
        need_grad=True,
        head_dim=head_dim,
        head_dim_v=head_dim,
        capability=sm,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        cp_size=cp_size,
        padded=padded,
    )


@pytest.fixture
def transformer_engine(monkeypatch):
    """A faked Transformer Engine 2.18 with flash-attn 2 and the given cuDNN (no flash-attn package)."""

    def fake(cudnn=(9, 10, 0), version=(2, 18, 0)):
        kernels = _optional.TransformerEngineKernels(cudnn=cudnn, flash_attn_2=True, flash_attn_3=False)
        for name, value in (
            ("has_transformer_engine", True),
            ("transformer_engine_version", version),
            ("transformer_engine_kernels", kernels),
            ("has_flash_attn", False),
            ("has_varlen_attn", True),
        ):
            monkeypatch.setattr(_optional, name, lambda value=value: value)

    monkeypatch.delenv(select.ENV_VAR, raising=False)
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
    monkeypatch.setattr(select, "_LOGGED", set())
    return fake


def test_auto_falls_back_from_te_where_te_would_find_no_backend(transformer_engine, caplog):
    """Issue 26: sm120 with cuDNN < 9.18.1 under CP: ``auto`` picked ``te`` and TE raised "no backend"."""
    transformer_engine(cudnn=(9, 10, 0))
    with caplog.at_level(logging.INFO, logger="thdpack.attention"):
        backend, reason = choose_backend("auto", situation())
        log_choice(backend, reason, situation())
    assert backend == "flash"  # thdpack's ring with FlashAttention-2 tiles
    assert "skipped te (backend 'te': Transformer Engine 2.18.0 has no attention backend for this call" in reason
    assert "THD on sm120 needs cuDNN >= 9.18.1, found 9.10.0" in caplog.records[-1].getMessage()
    with pytest.raises(ValueError, match=r"backend 'te': Transformer Engine 2\.18\.0 has no attention backend .* use "):
        choose_backend("te", situation())
    transformer_engine(cudnn=(9, 18, 1))
    assert choose_backend("auto", situation())[0] == "te"
    assert choose_backend("auto", situation(padded=False, cp_size=1))[0] == "te"  # FlashAttention 2 takes it


def test_deterministic_training_below_sm90_is_read_from_te_s_environment_variable(transformer_engine, monkeypatch):
    transformer_engine()
    a100 = situation(sm=(8, 0))
    assert choose_backend("auto", a100)[0] == "te"
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    backend, reason = choose_backend("auto", a100)
    assert backend == "flash" and "FusedAttention: deterministic training below sm90" in reason


def test_te_s_all_to_all_sees_the_repeated_kv_heads(transformer_engine):
    """thdpack repeats KV heads until cp divides them (``te.attend``); TE's even-heads rule reads the result."""
    transformer_engine(cudnn=(9, 18, 1))
    assert te_facts(situation(comm="a2a", heads=(6, 1), cp_size=2, sm=(9, 0))).num_gqa_groups == 2
    odd = situation(comm="a2a", heads=(9, 3), cp_size=3, sm=(9, 0))
    assert te_facts(odd).num_gqa_groups == 3
    with pytest.raises(ValueError, match=r"cp_comm_type='a2a' needs even head counts, got 9 / 3"):
        choose_backend("te", odd)
    assert choose_backend("auto", odd)[0] == "varlen"  # thdpack's all-to-all around varlen_attn


def test_te_s_head_dim_assertion_is_refused_before_te_runs(transformer_engine):
    """TE < 2.15 asserts head_dim % 8 == 0 inside its all-to-all, which thdpack did not check first."""
    transformer_engine(cudnn=(9, 18, 1), version=(2, 14, 0))
    call = situation(comm="a2a", head_dim=36, sm=(9, 0))
    with pytest.raises(ValueError, match=r"asserts head_dim % 8 == 0, and the head dim is 36 \(TE 2\.15 dropped"):
        choose_backend("te", call)
    transformer_engine(cudnn=(9, 18, 1), version=(2, 15, 0))
    assert choose_backend("te", call)[0] == "te"


def test_nothing_is_predicted_without_the_gpu_or_the_heads(transformer_engine):
    transformer_engine()
    assert te_facts(dataclasses.replace(situation(), num_heads=None)) is None
    assert te_facts(dataclasses.replace(situation(), capability=None)) is None
