"""Placed CP attention on GPUs (NCCL, one GPU per rank): the CUDA backends' split and whole parts.

Each rank holds its shard of ``support.placement_cases.MIXED_PACKS`` in bf16 on its GPU and runs
``thd_attention(..., cp_group=topology)`` with ``flash`` (the ring with FlashAttention-2 tiles, whole
sequences through flash-attn), ``varlen`` (the same ring, whole sequences through torch's
varlen_attn), ``te`` (TE's own CP attention over each group's process group, whole sequences
through TE without CP) and ``math``; the issue's GPU criterion: out, dQ, dK, dV within 2x plain
PyTorch bf16 attention's error against an fp32 reference. Skipped without enough GPUs (the
CPU/gloo suite, tests/distributed/test_cp_placed_attention.py, is the exactness gate).
"""

from __future__ import annotations

import traceback

import pytest
import torch

from thdpack.attention import reference_attention, thd_attention
from thdpack.attention.backends.base import CallFacts
from thdpack.attention.select import BACKEND_TABLE
from thdpack.cp import shard
from thdpack.cp.topology import CpTopology
from thdpack.testing import run_distributed
from thdpack.thd.carriage import thd_meta

from support.attention_cases import assert_within_2x_plain, random_case
from support.placement_cases import MIXED_PACKS, placed_metadata, shard_rows

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]
BACKENDS = ("flash", "varlen", "te", "math")


def _grads(attend, q, k, v, dout):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves)
    out.backward(dout.to(out.dtype))
    return {"out": out.detach().float(), **{n: t.grad.float() for n, t in zip(("dq", "dk", "dv"), leaves, strict=True)}}


def _rank_errors(rank: int, world: int, cp_size: int) -> dict:
    """This rank's max errors per backend and plain bf16's, on its shard's real rows."""
    device = torch.device("cuda", rank)
    topology = CpTopology.create(cp_size, device_type="cuda")  # cp 4: the pairs' groups too
    thd = placed_metadata(MIXED_PACKS[cp_size])
    case = random_case(thd, 8, 2, 64, torch.float32, seed=cp_size)
    case = {name: t.to(device) for name, t in case.items()}
    global_thd = {k: v.to(device) if torch.is_tensor(v) else v for k, v in thd.items()}
    qkv = [case[n] for n in ("q", "k", "v")]

    def reference(q, k, v):
        return reference_attention(q, k, v, global_thd, causal=True)[0]

    want = _grads(reference, *qkv, case["dout"])
    plain = _grads(reference, *(t.bfloat16() for t in qkv), case["dout"])
    local = {k: v.to(device) if torch.is_tensor(v) else v for k, v in shard(thd, cp_size, rank).items()}
    index = shard_rows(shard(thd, cp_size, rank)).to(device)
    real = case["valid"][index]

    def errors(got):  # a rank's dK / dV are the global gradient's rows it holds
        return {n: float((got[n] - want[n][index])[real].abs().max()) for n in ("out", "dq", "dk", "dv")}

    result: dict = {"plain": {n: float((plain[n] - want[n])[index][real].abs().max()) for n in want}}
    mine = [t[index].bfloat16() for t in qkv]
    meta = thd_meta(local)
    with_grads = [t.detach().requires_grad_() for t in mine]  # the facts of a call with gradients
    facts = CallFacts.of(*with_grads, cp=True, cp_comm_type="p2p", need_lse=False, placed=True, cp_size=cp_size,
                         padded=meta.has_padding)  # fmt: skip
    for backend in BACKENDS:
        problem = BACKEND_TABLE[backend].problem(facts)
        if problem is not None:  # not installed, or this GPU cannot run it: a skip that says why
            result[backend] = {"skip": f"{type(problem).__name__}: {problem}"}
            continue

        def attend(q, k, v, backend=backend):
            return thd_attention(q, k, v, local, backend=backend, cp_group=topology)

        try:
            result[backend] = {"errors": errors(_grads(attend, *mine, case["dout"][index]))}
        except Exception:  # a failure of this backend only: the others still report
            result[backend] = {"error": traceback.format_exc()}
    return result


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def placed_runs(request) -> tuple[int, list[dict]]:
    cp_size = request.param
    if torch.cuda.device_count() < cp_size:
        pytest.skip(f"needs {cp_size} GPUs (NCCL, one per rank), found {torch.cuda.device_count()}")
    return cp_size, run_distributed(_rank_errors, cp_size, cp_size, backend="nccl")


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_backends_on_placed_shards_are_within_2x_plain_bf16_error(placed_runs, backend):
    """A backend that cannot run here is a skip naming why, one that raises fails (it was dropped
    silently, either way)."""
    cp_size, results = placed_runs
    assert_within_2x_plain(results, backend, "plain", f"on a placed cp {cp_size} shard here")
