"""Shared builders for the attention tests: THD metadata from lengths, shards, the oracle's grads."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

import thdpack._optional as _optional
from thdpack.attention import reference_attention
from thdpack.cp import partition_indices

# (name, real lengths) mixes from research/ring_attention.md section 6; "{m}" = 2 * cp_size
LENGTH_MIXES: dict[str, Callable[[int], list[int]]] = {
    "exactly 2cp": lambda m: [m],
    "length 1 padded": lambda m: [1, m + 3],
    "long + many short": lambda m: [9 * m + 5, 1, 2, 3, m - 1 if m > 1 else 1, 4],
    "not divisible": lambda m: [5, 17, m + 1, 3],
    "identical": lambda m: [2 * m, 2 * m, 2 * m],
}

# backend -> (the _optional check of its library, why it cannot run without it); the others are pure PyTorch
_LIBRARIES = {
    "varlen": ("has_varlen_attn", "torch.nn.attention.varlen needs torch >= 2.10"),
    "flash": ("has_flash_attn", "flash-attn is not installed (pip install 'thdpack[flash]')"),
    "te": ("has_transformer_engine", "Transformer Engine is not installed (pip install 'thdpack[te]')"),
}


def missing_library(backend: str) -> str | None:
    """Why ``backend`` cannot run here (its library is missing), or None when it can."""
    check, reason = _LIBRARIES.get(backend, (None, None))
    return reason if check is not None and not getattr(_optional, check)() else None


def make_thd(lengths: Sequence[int], cp_size: int = 1, *, multiple: int | None = None, tail: int = 0) -> dict:
    """Global THD metadata: slots rounded up to ``multiple`` (default 2*cp_size under CP, else 1),
    plus ``tail`` extra padding tokens in the last slot (a pack's tail padding)."""
    m = multiple if multiple is not None else (2 * cp_size if cp_size > 1 else 1)
    slots = [-(-n // m) * m for n in lengths]
    slots[-1] += tail
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    cu_padded = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_padded[1:] = torch.cumsum(torch.tensor(slots), 0)
    return {"cu_seqlens": cu, "cu_seqlens_padded": cu_padded, "max_seqlen": max(slots)}


def valid_rows(thd: dict) -> torch.Tensor:
    """(T,) bool: real tokens of the global batch."""
    cu, cu_padded = thd["cu_seqlens"].tolist(), thd["cu_seqlens_padded"].tolist()
    valid = torch.zeros(cu_padded[-1], dtype=torch.bool)
    for i in range(len(cu) - 1):
        valid[cu_padded[i] : cu_padded[i] + cu[i + 1] - cu[i]] = True
    return valid


def shard_of(thd: dict, cp_size: int, rank: int) -> tuple[dict, torch.Tensor]:
    """(the rank's THD metadata, its (T/cp,) int64 global token indices)."""
    total = int(thd["cu_seqlens_padded"][-1])
    if cp_size == 1:  # TE's partition needs even slots even for one rank; one rank keeps everything
        return {**thd, "cp_size": 1, "cp_rank": 0}, torch.arange(total)
    index = partition_indices(thd["cu_seqlens_padded"], total, cp_size, rank).to(torch.int64)
    return {**thd, "cp_size": cp_size, "cp_rank": rank}, index


def random_case(thd: dict, nq: int, nkv: int, head_dim: int, dtype: torch.dtype, seed: int) -> dict:
    """Global q, k, v and output / LSE gradients (zero on padding rows, as a -100 label gives)."""
    g = torch.Generator().manual_seed(seed)
    total = int(thd["cu_seqlens_padded"][-1])
    valid = valid_rows(thd)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    return {
        "q": rand(total, nq, head_dim),
        "k": rand(total, nkv, head_dim),
        "v": rand(total, nkv, head_dim),
        "dout": rand(total, nq, head_dim) * valid[:, None, None],
        "dlse": rand(nq, total) * valid,
        "valid": valid,
    }


def reference_results(case: dict, thd: dict, causal: bool, with_dlse: bool = True) -> dict:
    """The oracle in fp64: out, lse, and dq / dk / dv of ``sum(out*dout) + sum(lse*dlse)``."""
    q, k, v = (case[n].detach().to(torch.float64).requires_grad_() for n in ("q", "k", "v"))
    out, lse = reference_attention(q, k, v, thd, causal=causal)
    valid = case["valid"]
    loss = (out * case["dout"].double()).sum()
    if with_dlse:
        loss = loss + (lse.masked_fill(~valid, 0.0) * case["dlse"].double()).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    return {"out": out.detach(), "lse": lse.detach(), "dq": dq, "dk": dk, "dv": dv}


def max_errors(got: dict, want: dict, index: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """Largest |got - want| per quantity on the real rows of a shard (``index`` into the global)."""
    real = valid[index]
    errs = {}
    for name in ("out", "dq", "dk", "dv"):
        if name in got:
            diff = (got[name].detach().double() - want[name][index])[real]
            errs[name] = float(diff.abs().max()) if diff.numel() else 0.0
    if "lse" in got:
        diff = (got["lse"].detach().double() - want["lse"][:, index])[:, real]
        errs["lse"] = float(diff.abs().max()) if diff.numel() else 0.0
    return errs


def worst_errors(shards: list, want: dict, valid: torch.Tensor) -> dict[str, float]:
    """Largest :func:`max_errors` per quantity over ``shards`` (``(index, got)`` per rank)."""
    worst: dict[str, float] = {}
    for index, got in shards:
        for name, err in max_errors(got, want, index, valid).items():
            worst[name] = max(worst.get(name, 0.0), err)
    return worst


def autograd_results(case: dict, attend: Callable, *, with_dlse: bool = True) -> dict:
    """``attend(q, k, v) -> (out, lse)`` on the case's global tensors, with autograd's dq / dk / dv
    of ``sum(out * dout) + sum(lse * dlse)`` (LSE term optional)."""
    q, k, v = (case[n].clone().requires_grad_() for n in ("q", "k", "v"))
    out, lse = attend(q, k, v)
    loss = (out * case["dout"].to(out.dtype)).sum()
    if with_dlse:
        loss = loss + (lse.masked_fill(~case["valid"], 0.0) * case["dlse"].to(lse.dtype)).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    return {"out": out.detach(), "lse": lse.detach(), "dq": dq, "dk": dk, "dv": dv}


def global_errors(got: dict, want: dict, valid: torch.Tensor) -> dict[str, float]:
    """:func:`max_errors` over all (real) rows of a global batch."""
    return max_errors(got, want, torch.arange(len(valid)), valid)


def assert_within_2x_plain(per_rank: list[dict], backend: str, plain: str, where: str) -> None:
    """Every rank's errors of ``backend`` within 2x those of plain bf16 attention (``per_rank[r][plain]``),
    as the GPU criterion reads; a backend that cannot run is a skip naming why (``where`` it was run),
    one that raised fails (it was dropped silently, either way)."""
    for rank, results in enumerate(per_rank):
        outcome, baseline = results[backend], results[plain]
        if "skip" in outcome:
            pytest.skip(f"{backend} cannot run {where}: {outcome['skip']}")
        assert "error" not in outcome, f"rank {rank}: {outcome.get('error')}"
        for name, err in outcome["errors"].items():
            assert err <= 2 * baseline[name] + 1e-6, (rank, backend, name, outcome, baseline)
