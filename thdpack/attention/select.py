"""Which backend runs a call: the backend table, the ``auto`` preferences and the log line.

:data:`BACKEND_TABLE` holds one ``AttentionBackend`` per backend (one module each in
``thdpack.attention.backends``) and :data:`CP_ALGORITHMS` thdpack's context-parallel algorithms,
which a backend's ``cp`` names for a CP shard. ``auto`` walks :data:`PREFERENCES` for the call's
situation and takes the first backend whose ``problem`` is None, logging the choice and why the
faster ones were skipped; a backend forced by name that cannot run raises (``ImportError``
naming the extra, or ``ValueError`` naming what to pick instead).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Literal

import torch

from thdpack.attention.a2a import a2a_attend
from thdpack.attention.allgather import allgather_attention
from thdpack.attention.backends import flash, flex, math, sdpa, te, varlen
from thdpack.attention.backends.base import (
    AttendFn,
    AttentionBackend,
    AttentionCall,
    AttentionOutput,
    CallFacts,
    CpAlgorithm,
)
from thdpack.attention.config import Backend, check_backend
from thdpack.attention.placed import placed_attention
from thdpack.attention.ring import TileKernel, ring_attention

log = logging.getLogger("thdpack.attention")

ENV_VAR = "THDPACK_ATTENTION_BACKEND"
_LOGGED: set[tuple[str, str]] = set()


def _table(*rows: AttentionBackend) -> dict[Backend, AttentionBackend]:
    table = {row.name: row for row in rows}
    assert len(table) == len(rows), f"a backend is registered twice: {[row.name for row in rows]}"
    return table


BACKEND_TABLE: dict[Backend, AttentionBackend] = _table(
    te.BACKEND, flash.BACKEND, varlen.BACKEND, flex.BACKEND, sdpa.BACKEND, math.BACKEND
)
"""Every backend but ``"auto"``, by name."""


def _ring(kernel: TileKernel) -> AttendFn:
    def ring(q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor, call: AttentionCall) -> AttentionOutput:
        meta, group = call.meta, call.cp_group
        return ring_attention(
            q_TNH, k_TNH, v_TNH, meta, cp_group=group, causal=call.causal, scale=call.scale, kernel=kernel
        )

    return ring


def _all_gather(q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor, call: AttentionCall) -> AttentionOutput:
    meta, group = call.meta, call.cp_group
    return allgather_attention(q_TNH, k_TNH, v_TNH, meta, cp_group=group, causal=call.causal, scale=call.scale)


CP_ALGORITHMS: dict[CpAlgorithm, AttendFn] = {
    "ring_math": _ring("math"),
    "ring_flash": _ring("flash"),
    "all_gather": _all_gather,
}
"""thdpack's context-parallel algorithms (``"own"`` is the backend's own ``attend``, ``"a2a"`` the
backend's kernel inside the all-to-all: :data:`A2A_ALGORITHMS`)."""

A2A_ALGORITHMS: dict[Backend, AttendFn] = {name: a2a_attend(row.attend) for name, row in BACKEND_TABLE.items()}
"""Per backend: thdpack's all-to-all around its kernel (for ``te``, whose ``cp`` names its own
all-to-all, only on a per-sequence placement's shard, whose layout TE's does not know)."""

SituationKind = Literal["cuda half, cp", "cp", "cuda half", "cuda", "cpu"]
Preference = tuple[Backend, str]
"""A backend ``auto`` may pick and the reason it is the one to try at that place."""

PREFERENCES: dict[SituationKind, tuple[Preference, ...]] = {
    "cuda half, cp": (
        ("te", "Transformer Engine's fused kernels and its own context parallelism"),
        ("flash", "thdpack's ring with FlashAttention-2 tiles"),
        # the same ring; differs from flash only for a placement's whole sequences (varlen_attn there)
        ("varlen", "thdpack's ring with FlashAttention-2 tiles, whole sequences through torch varlen_attn"),
        ("math", "thdpack's ring with exact math tiles"),
    ),
    "cp": (("math", "thdpack's ring with exact math tiles (no CUDA fp16/bf16 kernels apply)"),),
    "cuda half": (
        ("te", "Transformer Engine's fused attention"),
        ("flash", "flash-attn varlen kernel"),
        ("varlen", "torch varlen_attn (FlashAttention-2)"),
        ("flex", "FlexAttention with a block-sparse document mask"),
        ("sdpa", "scaled_dot_product_attention with a dense mask"),
        ("math", "exact tiled math kernel"),
    ),
    "cuda": (
        ("flex", "FlexAttention, the fused kernel for fp32 on CUDA"),
        ("math", "exact tiled math kernel"),
    ),
    "cpu": (("math", "exact tiled math kernel: per-sequence tiles, LSE and backward on CPU"),),
}
"""``auto``'s candidates per kind of situation, fastest first; each list ends with ``math``, which always runs."""


def situation_kind(s: CallFacts) -> SituationKind:
    """The row of :data:`PREFERENCES` that applies to ``s`` (an all-to-all call's kernel runs on
    whole sequences: the row without CP)."""
    if s.cp and s.cp_comm_type != "a2a":
        return "cuda half, cp" if s.cuda_half else "cp"
    if s.cuda_half:
        return "cuda half"
    return "cuda" if s.device.type == "cuda" else "cpu"


def choose_backend(requested: str, s: CallFacts) -> tuple[Backend, str]:
    """``(backend, reason)`` for a call; raises when a forced backend cannot run.

    ``requested`` is the ``backend`` argument; when it is ``"auto"`` the environment variable
    ``THDPACK_ATTENTION_BACKEND`` (if set) forces a backend instead.
    """
    backend = check_backend(requested)
    reason = "requested"
    if backend == "auto" and os.environ.get(ENV_VAR):
        backend = check_backend(os.environ[ENV_VAR], f"{ENV_VAR} value")
        reason = f"forced by {ENV_VAR}"
    if backend != "auto":
        err = BACKEND_TABLE[backend].problem(s)
        if err is not None:
            raise err
        return backend, reason
    skipped = []
    for candidate, why in PREFERENCES[situation_kind(s)]:
        err = BACKEND_TABLE[candidate].problem(s)
        if err is None:
            if s.cp and s.cp_comm_type == "a2a":
                exchange = "Transformer Engine's own" if candidate == "te" else "thdpack's"
                why = f"{why}, on whole sequences for Nq / cp heads after {exchange} all-to-all"
            if skipped:
                why = f"{why}; skipped {'; '.join(skipped)}"
            return candidate, why
        skipped.append(f"{candidate} ({err})")
    raise AssertionError("the 'math' backend always runs")


def attend_function(backend: Backend, s: CallFacts) -> AttendFn:
    """What attends a call that ``backend`` runs: its kernel, or on a CP shard the algorithm its
    ``cp`` names for ``s.cp_comm_type`` (the backend's own ``attend`` for ``"own"``); on a shard of
    a per-sequence placement both, part by part (:func:`thdpack.attention.placed.placed_attention`):
    the split sequences by its ``split_algorithm``, the whole ones by its kernel."""
    row = BACKEND_TABLE[backend]
    if s.placed and s.cp_comm_type == "a2a":  # the all-to-all gathers whole sequences from any layout
        return A2A_ALGORITHMS[backend]
    if s.placed:
        algorithm = row.split_algorithm(s.cp_comm_type)
        assert algorithm is not None, f"{backend!r} was chosen for a placed shard it cannot split"
        split = row.attend if algorithm == "own" else CP_ALGORITHMS[algorithm]
        return functools.partial(placed_attention, split=split, whole=row.attend)
    algorithm = row.cp[s.cp_comm_type] if s.cp else "own"
    if algorithm == "own":
        return row.attend
    return A2A_ALGORITHMS[backend] if algorithm == "a2a" else CP_ALGORITHMS[algorithm]


def log_choice(backend: str, reason: str, s: CallFacts) -> None:
    """INFO line, once per distinct (backend, reason, situation)."""
    key = (backend, f"{reason}|{s}")
    if key not in _LOGGED:
        _LOGGED.add(key)
        cp = f", context parallel ({s.cp_comm_type})" if s.cp else ""
        where = f"{s.device.type} {str(s.dtype).removeprefix('torch.')}{cp}"
        log.info("thdpack attention backend %r on %s: %s", backend, where, reason)
