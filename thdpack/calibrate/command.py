"""``thdpack calibrate``: time this machine for the run's model and write its profile.

    thdpack calibrate --model CONFIG --out machine.json                   # one process: kernels, host
    torchrun --nproc-per-node 8 -m thdpack.cli calibrate --model CONFIG --out machine.json   # and links
        [--backend auto] [--rank-tokens N] [--base h100_sxm] [--budget-s 50]

Every rank times its device and host (``thdpack.calibrate.kernels``), then the ranks of each node
their link and collectives, and one rank per node the network (``thdpack.calibrate.links``). Rank 0
writes the profile, every measured number citing where and when it was measured; what this launch
cannot measure comes from ``--base``, a shipped profile, with its sources.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from thdpack._settings import check_int
from thdpack.attention.backends.base import CallFacts
from thdpack.attention.select import choose_backend
from thdpack.calibrate.kernels import attention_curves, host_op_seconds, matmul_flops, memory_bandwidth
from thdpack.calibrate.links import LinkFit, measure_link
from thdpack.cp.topology import ranks_per_node
from thdpack.perf.machine import PROFILE_NAMES, MachineProfile, load_profile
from thdpack.perf.shape import NAMED_SHAPES, ModelShape, load_shape

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BASE_BY_GPU = (("GB200", "gb200_nvl72"), ("B200", "gb200_nvl72"), ("H200", "h200_sxm"), ("H100", "h100_sxm"),
               ("A100", "a100_sxm_80gb"))  # fmt: skip
"""The shipped profile a GPU's unmeasured numbers come from, matched in order against its name."""


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    models = ", ".join(NAMED_SHAPES)
    parser.add_argument("--model", required=True, help=f"the run's model: a config.json, one of {models}, or a preset")
    parser.add_argument("--out", type=Path, required=True, help="where to write the profile JSON")
    parser.add_argument("--backend", default="auto", help="the run's attention backend (thdpack.attention)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on GPUs, else float32")
    parser.add_argument("--rank-tokens", type=int, default=None, help="tokens per rank (default: 8192 GPU, 2048 CPU)")
    parser.add_argument("--base", default=None,
                        help=f"profile of what is not measured (default: by GPU name, cpu_gloo on the CPU): "
                        f"one of {', '.join(PROFILE_NAMES)} or a file")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=50.0, help="seconds to spend (the attention lengths stop)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (the fastest is kept)")


def run_calibrate(args: argparse.Namespace) -> int:
    tokens = 16 if args.rank_tokens is None else args.rank_tokens  # the default is chosen per device below
    check_effort(tokens, args.budget_s, args.repeats, flags=True)  # before any process joins
    started = _join_launch()
    device = _device()
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    profile = calibrate(
        load_shape(args.model), device=device, dtype=dtype, backend=args.backend,
        rank_tokens=(8192 if device.type == "cuda" else 2048) if args.rank_tokens is None else args.rank_tokens,
        base=load_profile(args.base or default_base(device)), budget_s=args.budget_s, repeats=args.repeats,
    )  # fmt: skip
    if not dist.is_initialized() or dist.get_rank() == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        profile.to_json(args.out)
        print(f"wrote {args.out} ({profile.name}) in {time.monotonic() - started:.1f} s")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def check_effort(rank_tokens: object, budget_s: object, repeats: object, *, flags: bool = False) -> None:
    """``ValueError`` / ``TypeError`` naming the first of the measuring sizes that cannot time
    anything: ``rank_tokens`` an int >= 16, ``budget_s`` a finite number > 0, ``repeats`` an int >= 1
    (``flags``: named as the command's options)."""
    name = (lambda n: "--" + n.replace("_", "-")) if flags else (lambda n: n)
    if check_int(name("rank_tokens"), rank_tokens, 1) < 16:
        raise ValueError(f"{name('rank_tokens')}={rank_tokens} is too few to time a kernel on; use at least 16")
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not 0 < budget_s < math.inf:
        raise ValueError(f"{name('budget_s')} must be a finite number of seconds > 0, got {budget_s!r}")
    check_int(name("repeats"), repeats, 1)


def calibrate(
    shape: ModelShape,
    *,
    device: torch.device,
    dtype: torch.dtype,
    backend: str,
    rank_tokens: int,
    base: MachineProfile,
    budget_s: float = 50.0,
    repeats: int = 3,
) -> MachineProfile:
    """This machine's profile; collective over the default group when there is one (every rank
    calls it), one process otherwise."""
    check_effort(rank_tokens, budget_s, repeats)
    start = time.monotonic()
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    facts = CallFacts(device=device, dtype=dtype, cp=False, cp_comm_type="p2p", need_lse=False, need_grad=True,
                      head_dim=shape.head_dim, head_dim_v=shape.head_dim, capability=capability)  # fmt: skip
    backend = choose_backend(backend, facts)[0]
    world = dist.get_world_size() if dist.is_initialized() else 1
    per_node = ranks_per_node(world) if world > 1 else 1
    shortest = 128 if device.type == "cuda" else 16
    lengths = [n for n in (2**i for i in range(4, 15)) if shortest <= n <= min(rank_tokens, 16384)]
    host = _mean(host_op_seconds(device=device, repeats=repeats), device)
    matmul = _mean(matmul_flops(shape, tokens=rank_tokens, device=device, dtype=dtype, repeats=repeats), device)
    copy_bytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    memory = _mean(memory_bandwidth(device=device, nbytes=copy_bytes, repeats=repeats), device)
    curves = attention_curves(shape, backend=backend, device=device, dtype=dtype, lengths=lengths,
                              tokens=rank_tokens, repeats=repeats, deadline=start + 0.6 * budget_s)  # fmt: skip
    attention = {k: _mean_curve(v, device) for k, v in asdict(curves).items() if k != "call_overhead_s"}
    call_overhead = _mean(curves.call_overhead_s, device)
    intra, inter = _links(device, world, per_node, repeats)
    measured = {
        "peak_flops": matmul,
        "matmul_efficiency": 1.0,
        "memory_bandwidth": memory,
        "attention.forward_causal": attention["forward_causal"],
        "attention.forward_full": attention["forward_full"],
        "attention.backward": attention["backward"],
        "host.op_s": host,
    }
    if device.type != "cuda":  # a GPU kernel's fixed cost hides behind its launch: the base profile's
        measured["attention.call_overhead_s"] = call_overhead
        measured["attention.tile"] = lengths[0]  # below it a sequence costs what the shortest does
    for prefix, fit in (("intra_node", intra), ("inter_node", inter)):
        if fit is not None:
            measured[f"{prefix}.bandwidth"] = fit.bandwidth
            measured[f"{prefix}.latency_s"] = fit.latency_s
    if intra is not None:
        measured["collective_base_latency_s"] = 0.0  # a collective's fixed cost is in its hop latency
        measured.update({f"collective_factors.{k}": v for k, v in intra.factors.items()})
    data = base.to_dict()
    for key, value in measured.items():
        _set(data, key, value)
    domain_spans = base.nvlink_domain > base.gpus_per_node and base.nvlink_domain % per_node == 0
    data.update(gpus_per_node=per_node, nvlink_domain=base.nvlink_domain if domain_spans else per_node)
    data["host"]["asynchronous"] = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    where = f"{platform.node()}, {datetime.date.today().isoformat()}, torch {torch.__version__}, {backend} backend"
    data["name"] = f"calibrated_{device.type}"
    data["description"] = f"{name} x {world} rank(s), {per_node} per node: measured by thdpack calibrate on {where}"
    data["sources"] = _sources(base, measured, where, shape, rank_tokens, dtype, intra, inter, world)
    return MachineProfile.from_dict(data)


def _sources(
    base: MachineProfile, measured: dict[str, Any], where: str, shape: ModelShape, tokens: int,
    dtype: torch.dtype, intra: LinkFit | None, inter: LinkFit | None, world: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every measured key's citation, the launch's, and the base profile's for the rest."""
    what = {
        ("peak_flops", "matmul_efficiency"): f"the model's GEMMs (QKV, output, MLP, logits) on {tokens} rows, "
        f"{dtype}; matmul_efficiency 1: peak_flops is the achieved rate",
        ("memory_bandwidth",): "a copy of a large buffer, bytes read and written per second",
        ("attention.",): f"thd_attention on batches of equal sequences ({tokens} tokens), heads {shape.heads} / "
        f"{shape.kv_heads} x {shape.head_dim}, {dtype}: causal forward, full forward, full backward; the fixed cost "
        "of a call on one token; the tile: the shortest length timed",
        ("host.op_s",): "a chain of small multiplications with autograd, forward and backward, host seconds per op",
        ("intra_node.",): f"RingComm.send_recv between the ranks of a node ({intra.ranks if intra else 0} ranks; sizes "
        f"{intra.sizes if intra else []} bytes), latency + bytes / bandwidth",
        ("inter_node.",): f"RingComm.send_recv between one rank per node ({inter.ranks if inter else 0} nodes)",
        ("collective_",): "all_reduce, all_gather, reduce_scatter, all_to_all over a node's ranks: busBw / algBw "
        "against the link's bandwidth (nccl-tests' convention); the fixed cost counted in the hop latency",
    }
    out = []
    for prefixes, how in what.items():
        keys = [k for k in measured if k.startswith(prefixes)]
        if keys:
            out.append({"keys": keys, "source": f"measured by thdpack calibrate on {where}", "url": "", "where": how})
    out.append({"keys": ["gpus_per_node", "nvlink_domain"], "source": f"the launch: {world} rank(s)", "url": "",
                "where": "torchrun's LOCAL_WORLD_SIZE (without torchrun: one process)"})  # fmt: skip
    taken = set(measured) | {"gpus_per_node", "nvlink_domain"}
    for s in base.sources:
        rest = [k for k in s.keys if k not in taken]
        if rest:
            source = f"from profile {base.name}: {s.source}"
            out.append({"keys": rest, "source": source, "url": s.url, "where": s.where})
    return out


def _links(device: torch.device, world: int, per_node: int, repeats: int) -> tuple[LinkFit | None, LinkFit | None]:
    """The node's link (every node at once) and, across nodes, one rank per node's."""
    if world == 1:
        return None, None
    sizes = [1 << 16, 1 << 20, 1 << 24, 1 << 27] if device.type == "cuda" else [1 << 12, 1 << 16, 1 << 19, 1 << 22]
    rank, nodes = dist.get_rank(), world // per_node
    node_groups = [dist.new_group(list(range(n * per_node, (n + 1) * per_node))) for n in range(nodes)]
    intra = measure_link(node_groups[rank // per_node], device=device, sizes=sizes, repeats=repeats)
    if nodes == 1:
        return intra, None
    leaders = list(range(0, world, per_node))
    across = dist.new_group(leaders)
    inter = measure_link(across, device=device, sizes=sizes, repeats=repeats) if rank in leaders else None
    dist.barrier()
    return intra, inter


def _mean(value: float, device: torch.device) -> float:
    """The ranks' mean of ``value`` (itself in one process)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _mean_curve(points: list[list[float]], device: torch.device) -> list[list[float]]:
    """The ranks' mean rate at each length; every rank measured the lengths the slowest did."""
    count = len(points)
    if dist.is_initialized():
        n = torch.tensor([count], device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MIN)
        count = int(n)
    rates = [_mean(r, device) for _, r in points[:count]]
    return [[float(n), rate] for (n, _), rate in zip(points[:count], rates, strict=True)]


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *path, key = dotted.split(".")
    for part in path:
        data = data[part]
    data[key] = float(value) if isinstance(value, (float, np.floating)) else value


def _join_launch() -> float:
    """Join torchrun's process group (gloo on the CPU, NCCL on GPUs); the start time."""
    started = time.monotonic()
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return started


def _device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def default_base(device: torch.device) -> str:
    """The shipped profile a device's unmeasured numbers come from."""
    if device.type != "cuda":
        return "cpu_gloo"
    name = torch.cuda.get_device_name(device)
    return next((profile for key, profile in BASE_BY_GPU if key in name), "h100_sxm")
