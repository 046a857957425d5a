"""Context parallelism across GPUs (NCCL, one GPU per rank): the paths the CPU suite cannot reach.

- Transformer Engine's own CP attention (``te``) on an ordinary shard (TE's layout,
  ``thdpack.cp.shard``): the ring (``p2p``) causal and not, the all-gather (TE >= 2.18), and the
  all-to-all with KV heads repeated for the exchange (Nkv = 1 at cp 2);
- thdpack's all-gather and reduce-scatter of rows over NCCL (``thdpack.cp.comm``), alone and
  inside thdpack's all-gather attention (``math``, fp32).

bf16 results are within 2x plain PyTorch bf16 attention's error against the fp32 oracle (the
project's GPU criterion); fp32 within 1e-4. One launch of 2 ranks serves every test. A case that
cannot run here is a skip naming why (the package is missing, or thdpack's selection says this
GPU / Transformer Engine cannot take the call); one that raises while running fails its test.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist

from thdpack.attention import reference_attention, thd_attention
from thdpack.attention.backends.base import CallFacts
from thdpack.attention.select import BACKEND_TABLE
from thdpack.cp.comm import all_gather_rows, reduce_scatter_rows
from thdpack.testing import run_distributed
from thdpack.thd.carriage import thd_meta

from support.attention_cases import make_thd, max_errors, random_case, reference_results, shard_of

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]
CP = 2
LENGTHS = [5, 1, 170, 64, 33]
"""Slots padded to 2*cp (so ``pad_between_seqs``, as nearly every CP batch), one sequence of length 1."""
CASES = {
    # name: (backend, cp_comm_type, causal, (Nq, Nkv), dtype)
    "te p2p causal": ("te", "p2p", True, (8, 2), torch.bfloat16),
    "te p2p non-causal": ("te", "p2p", False, (8, 2), torch.bfloat16),
    "te all_gather causal": ("te", "all_gather", True, (8, 2), torch.bfloat16),
    "te a2a repeated kv heads": ("te", "a2a", True, (8, 1), torch.bfloat16),
    "te a2a non-causal": ("te", "a2a", False, (8, 2), torch.bfloat16),
    "thdpack all_gather over nccl": ("math", "all_gather", True, (4, 2), torch.float32),
}


def _device(rank: int) -> torch.device:
    return torch.device("cuda", rank)


def _on(device: torch.device, thd: dict) -> dict:
    return {key: value.to(device) if torch.is_tensor(value) else value for key, value in thd.items()}


def _case_on_rank(rank: int, name: str) -> dict:
    """This rank's errors for case ``name`` and plain bf16's; or why it cannot run here."""
    backend, comm, causal, (nq, nkv), dtype = CASES[name]
    device = _device(rank)
    thd = make_thd(LENGTHS, CP)
    case = {key: t.to(device) for key, t in random_case(thd, nq, nkv, 64, torch.float32, seed=len(name)).items()}
    local, index = shard_of(thd, CP, rank)
    local, index, thd = _on(device, local), index.to(device), _on(device, thd)
    q, k, v = (case[n][index].to(dtype) for n in ("q", "k", "v"))
    with_grads = [t.detach().requires_grad_() for t in (q, k, v)]  # the facts of a call with gradients
    facts = CallFacts.of(
        *with_grads, cp=True, cp_comm_type=comm, need_lse=False, cp_size=CP, padded=thd_meta(local).has_padding
    )
    problem = BACKEND_TABLE[backend].problem(facts)
    if problem is not None:
        return {"skip": f"{type(problem).__name__}: {problem}"}
    want = reference_results(case, thd, causal, with_dlse=False)
    try:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = thd_attention(
            *leaves, local, backend=backend, causal=causal, cp_group=dist.group.WORLD, cp_comm_type=comm
        )
        grads = torch.autograd.grad((out * case["dout"][index].to(out.dtype)).sum(), leaves)
    except Exception:  # a failure of this case only: the other cases still report
        return {"error": traceback.format_exc()}
    got = {"out": out.detach(), **dict(zip(("dq", "dk", "dv"), grads, strict=True))}
    errors = max_errors(got, want, index, case["valid"])
    bf16 = [case[n].bfloat16().requires_grad_() for n in ("q", "k", "v")]
    plain_out, _ = reference_attention(*bf16, thd, causal=causal)
    plain = torch.autograd.grad((plain_out * case["dout"]).sum(), bf16)
    everything = torch.arange(len(case["valid"]), device=device)
    plain_got = {"out": plain_out.detach(), **dict(zip(("dq", "dk", "dv"), plain, strict=True))}
    return {"errors": errors, "plain": max_errors(plain_got, want, everything, case["valid"])}


def _rows(rank: int, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(count, 3, 4) integer-valued rows of ``rank``, a transposed (non-contiguous) view."""
    values = torch.arange(count * 12, device=device).reshape(count, 4, 3) + 100 * rank
    return values.to(dtype).transpose(1, 2)


def _rows_on_rank(rank: int) -> dict[str, bool]:
    """``all_gather_rows`` / ``reduce_scatter_rows`` over NCCL in bf16 and fp32 (every sum exact)."""
    device = _device(rank)
    checks = {}
    for dtype in (torch.bfloat16, torch.float32):
        gathered = all_gather_rows(_rows(rank, 5, dtype, device), dist.group.WORLD)
        everyone = torch.cat([_rows(r, 5, dtype, device) for r in range(CP)])
        checks[f"all_gather {dtype}"] = torch.equal(gathered, everyone)
        scattered = reduce_scatter_rows(_rows(rank, 5 * CP, dtype, device), dist.group.WORLD)
        total = sum(_rows(r, 5 * CP, dtype, device) for r in range(CP))
        checks[f"reduce_scatter {dtype}"] = torch.equal(scattered, total[5 * rank : 5 * (rank + 1)])
    return checks


def _rank_main(rank: int, world_size: int) -> dict:
    return {"rows": _rows_on_rank(rank), **{name: _case_on_rank(rank, name) for name in CASES}}


@pytest.fixture(scope="module")
def gpu_runs() -> list[dict]:
    if torch.cuda.device_count() < CP:
        pytest.skip(f"needs {CP} GPUs (NCCL, one per rank), found {torch.cuda.device_count()}")
    return run_distributed(_rank_main, CP, backend="nccl")


def test_rows_all_gather_and_reduce_scatter_over_nccl(gpu_runs):
    for rank, result in enumerate(gpu_runs):
        assert all(result["rows"].values()), (rank, result["rows"])


@pytest.mark.parametrize("name", list(CASES))
def test_cp_attention_on_gpus(gpu_runs, name):
    dtype = CASES[name][-1]
    for rank, result in enumerate(gpu_runs):
        outcome = result[name]
        if "skip" in outcome:
            pytest.skip(f"{name} cannot run here: {outcome['skip']}")
        assert "error" not in outcome, f"rank {rank}: {outcome.get('error')}"
        for quantity, err in outcome["errors"].items():
            limit = 1e-4 if dtype == torch.float32 else 2 * outcome["plain"][quantity] + 1e-6
            assert err <= limit, (rank, name, quantity, outcome)
