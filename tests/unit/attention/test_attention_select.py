"""Backend selection: the backend table, the ``auto`` preferences, the log line, forcing, and unavailable backends."""

from __future__ import annotations

import logging

import pytest
import torch

import thdpack._optional as _optional
from thdpack.attention import BACKENDS, select
from thdpack.attention.backends import flash, flex, math, sdpa, te, varlen
from thdpack.attention.select import (
    A2A_ALGORITHMS,
    BACKEND_TABLE,
    CP_ALGORITHMS,
    PREFERENCES,
    CallFacts,
    choose_backend,
    log_choice,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
TE_KERNELS = _optional.TransformerEngineKernels(cudnn=(9, 10, 0), flash_attn_2=True, flash_attn_3=False)
"""What a fake Transformer Engine finds: cuDNN 9.10 and flash-attn 2 (the usual pip install)."""


def _situation(
    device=CPU,
    dtype=torch.float32,
    *,
    cp=False,
    comm="p2p",
    lse=False,
    grad=True,
    head_dim=64,
    head_dim_v=None,
    sm=None,
    placed=False,
):
    capability = (sm if sm is not None else (9, 0)) if device.type == "cuda" else None
    return CallFacts(
        device=device,
        dtype=dtype,
        cp=cp or placed,
        placed=placed,
        cp_comm_type=comm,
        need_lse=lse,
        need_grad=grad,
        head_dim=head_dim,
        head_dim_v=head_dim if head_dim_v is None else head_dim_v,
        capability=capability,
    )


@pytest.fixture
def installed(monkeypatch):
    """Pretend which optional packages import: installed(te=..., flash=..., varlen=..., flex=...,
    te_version=..., te_kernels=..., flash_version=...)."""

    def set_installed(
        *,
        te=False,
        flash=False,
        varlen=False,
        flex=True,
        te_version=(2, 20, 0),
        te_kernels=TE_KERNELS,
        flash_version=(2, 8, 3),
    ):
        for name, value in (
            ("has_transformer_engine", te),
            ("transformer_engine_version", te_version if te else None),
            ("transformer_engine_kernels", te_kernels if te else None),
            ("has_flash_attn", flash),
            ("flash_attn_version", flash_version if flash else None),
            ("has_varlen_attn", varlen),
            ("has_flex_attention", flex),
        ):
            monkeypatch.setattr(_optional, name, lambda value=value: value)

    monkeypatch.delenv(select.ENV_VAR, raising=False)
    monkeypatch.setattr(select, "_LOGGED", set())  # "once" counts from this test on
    return set_installed


@pytest.mark.parametrize(
    ("packages", "situation", "expected"),
    [
        ({"te": True, "flash": True, "varlen": True}, _situation(CUDA, torch.bfloat16), "te"),
        ({"te": True, "flash": True}, _situation(CUDA, torch.bfloat16, lse=True), "flash"),  # TE has no LSE
        ({"varlen": True}, _situation(CUDA, torch.float16), "varlen"),
        ({}, _situation(CUDA, torch.float16), "flex"),
        ({"flex": False}, _situation(CUDA, torch.float16, lse=True), "math"),
        ({"flex": False}, _situation(CUDA, torch.float16), "sdpa"),
        ({"te": True}, _situation(CUDA, torch.bfloat16, cp=True), "te"),
        ({}, _situation(CUDA, torch.bfloat16, cp=True), "flash"),  # thdpack's ring, FA2 tiles
        ({}, _situation(CUDA, torch.bfloat16, cp=True, comm="all_gather"), "math"),
        ({"te": True, "flash": True}, _situation(CUDA, torch.float32), "flex"),
        ({"te": True, "flash": True, "varlen": True}, _situation(CPU, torch.float32), "math"),
        ({}, _situation(CPU, torch.float64, cp=True), "math"),
        # a placed shard: the whole sequences need the backend's own kernel as well
        ({"te": True}, _situation(CUDA, torch.bfloat16, placed=True), "te"),
        ({"flash": True}, _situation(CUDA, torch.bfloat16, placed=True), "flash"),
        ({"varlen": True}, _situation(CUDA, torch.bfloat16, placed=True), "varlen"),  # no flash-attn
        ({}, _situation(CUDA, torch.bfloat16, placed=True), "math"),
        ({}, _situation(CPU, torch.float64, placed=True), "math"),
    ],
)
def test_auto_prefers_the_fastest_backend_that_can_run(installed, packages, situation, expected):
    installed(**packages)
    assert choose_backend("auto", situation)[0] == expected


def test_auto_explains_what_it_skipped(installed):
    installed(flash=True)
    backend, reason = choose_backend("auto", _situation(CUDA, torch.bfloat16))
    assert backend == "flash"
    assert reason.startswith("flash-attn varlen kernel; skipped te (backend 'te' needs Transformer Engine")


def test_the_choice_is_logged_once(installed, caplog):
    installed()
    situation = _situation(CPU, torch.float64)
    with caplog.at_level(logging.INFO, logger="thdpack.attention"):
        for _ in range(3):
            log_choice(*choose_backend("auto", situation), situation)
    lines = [r.getMessage() for r in caplog.records if r.name == "thdpack.attention"]
    assert lines == [
        "thdpack attention backend 'math' on cpu float64: exact tiled math kernel: per-sequence tiles, "
        "LSE and backward on CPU"
    ]


def test_the_environment_variable_forces_a_backend(installed, monkeypatch):
    installed()
    monkeypatch.setenv(select.ENV_VAR, "sdpa")
    assert choose_backend("auto", _situation()) == ("sdpa", "forced by THDPACK_ATTENTION_BACKEND")
    assert choose_backend("math", _situation())[0] == "math"  # an explicit argument wins
    monkeypatch.setenv(select.ENV_VAR, "fastest")
    with pytest.raises(ValueError, match="unknown THDPACK_ATTENTION_BACKEND value 'fastest'; valid: 'auto', 'te'"):
        choose_backend("auto", _situation())


@pytest.mark.parametrize(
    ("backend", "situation", "error", "message"),
    [
        (
            "te",
            _situation(CUDA, torch.bfloat16),
            ImportError,
            r"pip install 'thdpack\[te\]' on a CUDA machine",
        ),
        ("flash", _situation(CUDA, torch.bfloat16), ImportError, r"pip install 'thdpack\[flash\]'"),
        (
            "varlen",
            _situation(CUDA, torch.float16),
            ImportError,
            r"needs torch.nn.attention.varlen \(torch >= 2.10\)",
        ),
        ("sdpa", _situation(lse=True), ValueError, "backend 'sdpa' does not return the LSE"),
        ("flex", _situation(grad=True), ValueError, "backend 'flex' has no backward on CPU"),
        ("sdpa", _situation(cp=True), ValueError, "backend 'sdpa' has no context-parallel path"),
        (
            "flash",
            _situation(CUDA, torch.float32, cp=True),
            ValueError,
            "need float16 or bfloat16, got torch.float32",
        ),
        (
            "flash",
            _situation(CUDA, torch.float16, cp=True, comm="all_gather"),
            ValueError,
            r"no context-parallel path for cp_comm_type='all_gather' \(it has 'p2p', 'a2a'\); use cp_comm_type='p2p' "
            "or 'a2a', or backend='math'",
        ),
        ("flex", _situation(CUDA, torch.float16, cp=True, comm="p2p"), ValueError, r"\(it has 'a2a'\)"),
        ("nope", _situation(), ValueError, "unknown attention backend 'nope'; valid: 'auto', 'te', 'flash'"),
    ],
)
def test_a_forced_backend_that_cannot_run_says_why(installed, backend, situation, error, message):
    installed()
    with pytest.raises(error, match=message):
        choose_backend(backend, situation)


def test_cuda_kernels_refuse_cpu_tensors(installed):
    installed(flash=True, varlen=True)
    for backend in ("flash", "varlen"):
        with pytest.raises(ValueError, match=f"backend '{backend}': FlashAttention kernels need CUDA tensors"):
            choose_backend(backend, _situation(CPU, torch.float16))


def test_te_without_lse_support_is_refused_when_the_lse_is_asked_for(installed):
    installed(te=True)
    with pytest.raises(ValueError, match="backend 'te' does not return the LSE"):
        choose_backend("te", _situation(CUDA, torch.bfloat16, lse=True))
    assert choose_backend("te", _situation(CUDA, torch.bfloat16)) == ("te", "requested")


def test_flex_forward_without_gradients_is_allowed_on_cpu(installed):
    installed()
    assert choose_backend("flex", _situation(grad=False))[0] == "flex"


def test_every_backend_is_registered_once_under_its_name():
    modules = {"te": te, "flash": flash, "varlen": varlen, "flex": flex, "sdpa": sdpa, "math": math}
    assert list(BACKEND_TABLE) == [b for b in BACKENDS if b != "auto"] == list(modules)
    for name, row in BACKEND_TABLE.items():
        assert row.name == name and row is modules[name].BACKEND


def test_a_backend_registered_twice_is_refused():
    with pytest.raises(AssertionError, match="a backend is registered twice"):
        select._table(math.BACKEND, flex.BACKEND, math.BACKEND)


def test_preferences_name_registered_backends_and_end_with_math():
    for kind, preferences in PREFERENCES.items():
        names = [name for name, _ in preferences]
        assert set(names) <= set(BACKEND_TABLE), kind
        assert len(set(names)) == len(names) and names[-1] == "math", kind


def test_every_cp_algorithm_a_backend_names_exists():
    named = {algorithm for row in BACKEND_TABLE.values() for algorithm in row.cp.values()}
    assert named - {"own", "a2a"} == set(CP_ALGORITHMS)
    assert set(A2A_ALGORITHMS) == set(BACKEND_TABLE)  # te: only on a placed shard


def test_every_backend_runs_the_all_to_all():
    """a2a needs only a kernel for whole sequences: every backend has it (te its own)."""
    assert {name: row.cp.get("a2a") for name, row in BACKEND_TABLE.items()} == {
        "te": "own",
        "flash": "a2a",
        "varlen": "a2a",
        "flex": "a2a",
        "sdpa": "a2a",
        "math": "a2a",
    }


# (backend, situation, packages) -> None when it runs, else (error type, message); one column per backend
_HALF, _HALF_CP = _situation(CUDA, torch.bfloat16), _situation(CUDA, torch.bfloat16, cp=True)
_PROBLEMS = [
    ("math", _situation(CPU, torch.float64, cp=True, comm="all_gather", lse=True), {}, None),
    ("te", _HALF, {"te": True}, None),
    ("te", _HALF, {}, (ImportError, "backend 'te' needs Transformer Engine")),
    ("te", _situation(CUDA, torch.float32), {"te": True}, (ValueError, "needs CUDA float16/bfloat16 tensors")),
    ("te", _situation(CUDA, torch.bfloat16, cp=True, comm="all_gather"), {"te": True}, None),  # TE's own CP
    ("flash", _HALF, {"flash": True}, None),
    ("flash", _HALF_CP, {}, None),  # the ring's FA2 tiles come with torch, not flash-attn
    ("flash", _situation(CPU, torch.float16, cp=True), {}, (ValueError, "under context parallelism: FlashAttention")),
    ("varlen", _HALF, {"varlen": True}, None),
    ("varlen", _situation(CUDA, torch.float32), {"varlen": True}, (ValueError, "need float16 or bfloat16")),
    (
        "varlen",
        _situation(CUDA, torch.float16, cp=True, comm="all_gather"),
        {"varlen": True},
        (ValueError, "no context-parallel path for cp_comm_type='all_gather'"),
    ),
    ("flex", _situation(CUDA, torch.float32, lse=True), {}, None),
    ("flex", _HALF, {"flex": False}, (ImportError, "backend 'flex' needs torch.nn.attention.flex_attention")),
    ("flex", _HALF_CP, {}, (ValueError, "backend 'flex' has no context-parallel path")),
    ("sdpa", _situation(grad=True), {}, None),
    ("sdpa", _situation(CUDA, torch.float16, lse=True), {}, (ValueError, "backend 'sdpa' does not return the LSE")),
    # a2a: the backend's own kernel on whole sequences, so its kernel's rules apply (not the ring's)
    ("math", _situation(CPU, torch.float64, cp=True, comm="a2a", lse=True), {}, None),
    ("sdpa", _situation(cp=True, comm="a2a"), {}, None),
    ("sdpa", _situation(cp=True, comm="a2a", lse=True), {}, (ValueError, "backend 'sdpa' does not return the LSE")),
    ("flex", _situation(CUDA, torch.bfloat16, cp=True, comm="a2a", lse=True), {}, None),
    ("flex", _situation(cp=True, comm="a2a"), {}, (ValueError, "backend 'flex' has no backward on CPU")),
    ("flex", _situation(cp=True, comm="a2a", grad=False), {}, None),
    ("flash", _situation(CUDA, torch.bfloat16, cp=True, comm="a2a"), {}, (ImportError, "pip install 'thdpack[flash]'")),
    ("flash", _situation(CUDA, torch.bfloat16, cp=True, comm="a2a"), {"flash": True}, None),
    ("varlen", _situation(CUDA, torch.float32, cp=True, comm="a2a"), {"varlen": True}, (ValueError, "need float16")),
    ("te", _situation(CUDA, torch.bfloat16, cp=True, comm="a2a"), {"te": True}, None),  # TE's own all-to-all
    # a placed shard: the backend's kernel for the whole sequences, its split algorithm for the rest
    ("math", _situation(CPU, torch.float64, placed=True, comm="all_gather", lse=True), {}, None),
    ("sdpa", _situation(CPU, torch.float64, placed=True), {}, None),  # split part: the math ring
    ("sdpa", _situation(CPU, torch.float64, placed=True, comm="all_gather"), {}, None),
    ("sdpa", _situation(placed=True, lse=True), {}, (ValueError, "backend 'sdpa' does not return the LSE")),
    ("flex", _situation(CPU, torch.float64, placed=True, grad=False), {}, None),
    ("flex", _situation(placed=True), {}, (ValueError, "backend 'flex' has no backward on CPU")),
    ("flash", _situation(CUDA, torch.bfloat16, placed=True), {"flash": True}, None),
    ("flash", _situation(CUDA, torch.bfloat16, placed=True), {}, (ImportError, "needs flash-attn")),
    (
        "varlen",
        _situation(CUDA, torch.bfloat16, placed=True, comm="all_gather"),
        {"varlen": True},
        (ValueError, "no context-parallel path"),
    ),
    ("te", _situation(CUDA, torch.bfloat16, placed=True, comm="all_gather"), {"te": True}, None),
    ("te", _situation(CUDA, torch.bfloat16, placed=True), {"te": True, "te_version": (2, 17, 0)}, None),
    # a placed shard with a2a: the all-to-all gathers whole sequences, so only the kernel's rules apply
    ("te", _situation(CUDA, torch.bfloat16, placed=True, comm="a2a"), {"te": True}, None),
    ("sdpa", _situation(CPU, torch.float64, placed=True, comm="a2a"), {}, None),
    ("flex", _situation(placed=True, comm="a2a"), {}, (ValueError, "backend 'flex' has no backward on CPU")),
]


@pytest.mark.parametrize(("backend", "situation", "packages", "expected"), _PROBLEMS)
def test_each_backend_states_its_problem(installed, backend, situation, packages, expected):
    installed(**packages)
    problem = BACKEND_TABLE[backend].problem(situation)
    if expected is None:
        assert problem is None
    else:
        assert isinstance(problem, expected[0]) and expected[1] in str(problem), problem


@pytest.mark.parametrize(
    ("backend", "situation", "runs"),
    [
        ("math", _situation(), math.BACKEND.attend),
        ("math", _situation(cp=True), CP_ALGORITHMS["ring_math"]),
        ("math", _situation(cp=True, comm="all_gather"), CP_ALGORITHMS["all_gather"]),
        ("flash", _HALF, flash.BACKEND.attend),
        ("flash", _HALF_CP, CP_ALGORITHMS["ring_flash"]),
        ("varlen", _HALF_CP, CP_ALGORITHMS["ring_flash"]),
        ("te", _HALF_CP, te.BACKEND.attend),  # TE exchanges K/V itself
        ("te", _situation(CUDA, torch.bfloat16, cp=True, comm="all_gather"), te.BACKEND.attend),
        ("sdpa", _situation(), sdpa.BACKEND.attend),
        ("math", _situation(cp=True, comm="a2a"), A2A_ALGORITHMS["math"]),
        ("sdpa", _situation(cp=True, comm="a2a"), A2A_ALGORITHMS["sdpa"]),
        ("varlen", _situation(CUDA, torch.bfloat16, cp=True, comm="a2a"), A2A_ALGORITHMS["varlen"]),
        ("te", _situation(CUDA, torch.bfloat16, cp=True, comm="a2a"), te.BACKEND.attend),
    ],
)
def test_a_cp_shard_runs_the_algorithm_the_table_names(backend, situation, runs):
    assert select.attend_function(backend, situation) is runs


# --- rules that keep a GPU from crashing (issue 11, defects 2-4): faked versions, GPUs and shapes


def test_te_all_gather_needs_transformer_engine_2_18_for_thd(installed, caplog):
    situation = _situation(CUDA, torch.bfloat16, cp=True, comm="all_gather")
    installed(te=True, te_version=(2, 17, 1))
    with pytest.raises(ValueError, match=r"needs Transformer Engine >= 2\.18 for THD.*found 2\.17\.1"):
        choose_backend("te", situation)
    with caplog.at_level(logging.INFO, logger="thdpack.attention"):
        backend, reason = choose_backend("auto", situation)
        log_choice(backend, reason, situation)
    assert backend == "math" and "skipped te (backend 'te' with cp_comm_type='all_gather' needs" in reason
    assert "Transformer Engine >= 2.18" in caplog.records[-1].getMessage()
    installed(te=True, te_version=(2, 18, 0))
    assert choose_backend("te", situation)[0] == "te"
    installed(te=True, te_version=(2, 5, 0))  # the P2P ring took THD long before
    assert choose_backend("te", _situation(CUDA, torch.bfloat16, cp=True, comm="p2p"))[0] == "te"


@pytest.mark.parametrize(
    ("packages", "situation", "expected", "exchange"),
    [
        ({}, _situation(CPU, torch.float64, cp=True, comm="a2a"), "math", "thdpack's"),
        (
            {"te": True, "flash": True},
            _situation(CUDA, torch.bfloat16, cp=True, comm="a2a"),
            "te",
            "Transformer Engine's own",
        ),
        ({"flash": True}, _situation(CUDA, torch.bfloat16, cp=True, comm="a2a"), "flash", "thdpack's"),
        ({"varlen": True}, _situation(CUDA, torch.bfloat16, cp=True, comm="a2a"), "varlen", "thdpack's"),
        ({}, _situation(CUDA, torch.bfloat16, cp=True, comm="a2a"), "flex", "thdpack's"),  # not the ring's flash
        ({}, _situation(CUDA, torch.float32, cp=True, comm="a2a"), "flex", "thdpack's"),
    ],
)
def test_auto_under_a2a_picks_the_fastest_kernel_for_whole_sequences(
    installed, packages, situation, expected, exchange
):
    installed(**packages)
    backend, reason = choose_backend("auto", situation)
    assert backend == expected
    assert f"on whole sequences for Nq / cp heads after {exchange} all-to-all" in reason


def test_the_log_line_names_the_cp_comm_type(installed, caplog):
    installed()
    situation = _situation(CPU, torch.float64, cp=True, comm="a2a")
    with caplog.at_level(logging.INFO, logger="thdpack.attention"):
        log_choice(*choose_backend("auto", situation), situation)
    assert caplog.records[-1].getMessage() == (
        "thdpack attention backend 'math' on cpu float64, context parallel (a2a): exact tiled math kernel: "
        "per-sequence tiles, LSE and backward on CPU, on whole sequences for Nq / cp heads after thdpack's all-to-all"
    )


def test_te_a2a_needs_transformer_engine_2_10_for_thd(installed):
    situation = _situation(CUDA, torch.bfloat16, cp=True, comm="a2a")
    installed(te=True, te_version=(2, 9, 0))
    with pytest.raises(
        ValueError, match=r"cp_comm_type='a2a' needs Transformer Engine >= 2\.10 for THD.*found 2\.9\.0"
    ):
        choose_backend("te", situation)
    backend, reason = choose_backend("auto", situation)  # thdpack's all-to-all around the next kernel
    assert backend == "flex" and "skipped te (backend 'te' with cp_comm_type='a2a' needs" in reason
    installed(te=True, te_version=(2, 10, 0))
    assert choose_backend("te", situation)[0] == "te"


@pytest.mark.parametrize("sm", [(7, 0), (7, 5)])  # V100, T4
def test_flash_attention_2_kernels_are_skipped_below_sm80(installed, sm):
    installed(flash=True, varlen=True)
    backend, reason = choose_backend("auto", _situation(CUDA, torch.float16, sm=sm))
    assert backend == "flex"
    assert (
        f"flash (backend 'flash': FlashAttention-2 kernels need compute capability 8.0 (Ampere) or newer, this GPU is sm{sm[0]}{sm[1]}"
        in reason
    )
    assert choose_backend("auto", _situation(CUDA, torch.float16, cp=True, sm=sm))[0] == "math"  # no FA2 ring tiles
    for forced in ("flash", "varlen"):
        with pytest.raises(ValueError, match=r"compute capability 8\.0"):
            choose_backend(forced, _situation(CUDA, torch.float16, sm=sm))
    assert choose_backend("auto", _situation(CUDA, torch.float16, sm=(8, 0)))[0] == "flash"


@pytest.mark.parametrize(
    ("head_dim", "head_dim_v", "message"),
    [
        (72 + 4, None, "a multiple of 8 and at most 256, got 76"),
        (320, None, "a multiple of 8 and at most 256, got 320"),
        (128, 64, "V to have the head dim of Q and K \\(128\\), got 64"),
    ],
)
def test_flash_attention_2_kernels_are_skipped_for_head_dims_they_cannot_take(installed, head_dim, head_dim_v, message):
    installed(flash=True, varlen=True)
    situation = _situation(CUDA, torch.bfloat16, head_dim=head_dim, head_dim_v=head_dim_v)
    backend, reason = choose_backend("auto", situation)
    assert backend == "flex" and "flash (backend 'flash': FlashAttention-2" in reason
    assert "varlen (backend 'varlen': FlashAttention-2" in reason
    with pytest.raises(ValueError, match=message):
        choose_backend("varlen", situation)
    cp = _situation(CUDA, torch.bfloat16, cp=True, head_dim=head_dim, head_dim_v=head_dim_v)
    assert choose_backend("auto", cp)[0] == "math"
    with pytest.raises(ValueError, match=message):
        choose_backend("flash", cp)


@pytest.mark.parametrize("head_dim", [8, 64, 128, 256])
def test_head_dims_flash_attention_2_takes(installed, head_dim):
    installed(flash=True)
    assert choose_backend("auto", _situation(CUDA, torch.bfloat16, head_dim=head_dim))[0] == "flash"


def test_call_facts_read_the_head_dims_and_leave_the_capability_to_cuda():
    q, k, v = torch.zeros(4, 2, 16), torch.zeros(4, 1, 16, requires_grad=True), torch.zeros(4, 1, 8)
    facts = CallFacts.of(q, k, v, cp=False, cp_comm_type="p2p", need_lse=True)
    assert (facts.head_dim, facts.head_dim_v, facts.capability, facts.need_grad) == (16, 8, None, True)


def test_a_placed_shard_runs_the_split_algorithm_and_the_kernel():
    placed = _situation(CPU, torch.float64, placed=True)
    for backend, split in (
        ("math", "ring_math"),
        ("sdpa", "ring_math"),
        ("flex", "ring_math"),
        ("flash", "ring_flash"),
    ):
        row = BACKEND_TABLE[backend]
        assert row.split_algorithm("p2p") == split
        attend = select.attend_function(backend, placed)
        assert attend.keywords == {"split": CP_ALGORITHMS[split], "whole": row.attend}
    assert BACKEND_TABLE["sdpa"].split_algorithm("all_gather") == "all_gather"
    assert BACKEND_TABLE["flash"].split_algorithm("all_gather") is None
    assert select.attend_function("te", _situation(CUDA, torch.bfloat16, placed=True)).keywords["split"] is te.attend


def test_flash_attn_before_2_6_is_refused_for_its_lse_shape(installed):
    """Issue 26: flash-attn <= 2.5.9 returns the varlen LSE as (S, Nq, max_seqlen); only pyproject pinned >= 2.6."""
    situation = _situation(CUDA, torch.bfloat16, lse=True)
    installed(flash=True, varlen=True, flash_version=(2, 5, 9))
    with pytest.raises(
        ImportError,
        match=r"backend 'flash' needs flash-attn >= 2\.6, found 2\.5\.9, whose flash_attn_varlen_func returns the LSE "
        r"padded per sequence, \(S, Nq, max_seqlen\), not \(Nq, T\); pip install 'flash-attn>=2\.6'",
    ):
        choose_backend("flash", situation)
    backend, reason = choose_backend("auto", situation)
    assert backend == "varlen" and "flash (backend 'flash' needs flash-attn >= 2.6, found 2.5.9" in reason
    installed(flash=True, varlen=True, flash_version=(2, 6, 0))
    assert choose_backend("auto", situation)[0] == "flash"
