"""The busiest CP rank's attention time, on one device: TE's layout vs per-sequence placement vs a2a.

``gpu_suite.py``'s ``cp_placement`` section runs :func:`measure` (``--tiny``: on the CPU in seconds).
``cp_balance.py`` counts the same comparison exactly in tiles and pairs; this times it with the real
kernels. One set of sequences is planned twice, ``plan_packs(..., cp_placement="te")`` and
``"adaptive"``; every pack of each plan is built by the packer (``thd_bench.planned_packs``),
collated (``thd_collate``), moved (``thd_to_device``) and sharded (``thdpack.cp.shard``), one pack
per step (a micro-batch of one pack). Modes:

- ``te``: Transformer Engine's layout, every sequence split over all ``cp`` ranks: each rank runs
  thdpack's ring (``thdpack.attention.ring``) over its shard;
- ``adaptive``: the per-sequence placement (docs/design/cp_placement.md): each rank runs its shard's
  parts (``thdpack.thd.parts``) as ``thdpack.attention.placed`` does: the ring over each split group
  (the part's own record, ``cp_size = g``), the backend's own kernel on its whole sequences;
- ``a2a``: thdpack's all-to-all (``thdpack.attention.a2a``) on ``te``'s packs: every rank runs the
  backend's kernel on every sequence whole for ``Nq / cp`` query heads (and ``Nkv * f / cp`` KV
  heads, ``f = kv_replication``): the same work on every rank, timed once per pack;
- ``a2a_adaptive``: the same on ``adaptive``'s packs (CP padding only inside split sequences).

Time of a rank: forward + backward (``torch.autograd.grad`` of the output) of all its parts, as
``thd_attention`` runs its shard, median of ``repeats`` after one warm-up (which builds the
record's caches, as a step's first layer does), synchronized and read with ``perf_counter`` (so a
rank whose kernels are too small to fill the device pays its host time, as it does in training).
Per pack (a step waits for its slowest rank) the busiest rank's time is the max over ranks of
their totals, the mean-rank time their mean; both are summed over the plan's packs (an epoch of
this data).

One rank alone (:class:`EchoRing`): no process group, so each rank's ring runs with a ring
object whose ``send_recv`` hands back the tensors it was given, standing in for the ``g - 1``
peers. The tile work is exactly the real ring's, because

1. ``ring_forward`` / ``ring_backward`` take every tile's query rows, key rows and causal mask from
   the record and ``(rank, step)`` alone (``_tile_plan``: ``local_placement(meta, rank)`` for the
   queries, ``local_placement(meta, (rank - step) % g)`` for the block that arrives at ``step``),
   never from the tensors received, and the FlashAttention / math tiles key only on those
   placements (row counts, and for full tiles the real keys of the sending rank, both from the
   record);
2. in TE's layout, which a split part is within its group, every rank holds ``slot / g`` rows of
   every sequence, so the block a peer would send has exactly the shape of this rank's own: the
   echoed tensors are shaped as the real ones, and so is the travelling dK / dV accumulator;
3. only values differ, and attention kernels do the same work whatever the values.

``tests/benchmarks/test_cp_rank_timing.py`` checks 1 and 2: every rank's tiles (shapes, rows, real
keys, positions, masks; forward and backward) equal those of the threaded ring
(``simulated_ring_attention``).

Not timed: the communication. The ring's K/V and dK/dV transfers (the real ring overlaps each with
the step's tile; a rank waits where a transfer outlasts it) and the all-to-alls of ``a2a`` (four
per layer and step, on the critical path: the kernel waits for them) need several devices;
``cp_balance.py`` counts their bytes. The echo hands back the very tensors (no copy): the ring
never writes into a received K/V block, and dK/dV accumulate into whatever arrives, as into a
receive buffer.

Legend: ``T`` tokens on a rank, ``N`` heads, ``H`` head dim.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cp_balance
import numpy as np
import thd_bench
import torch

from thdpack.attention.api import thd_attention
from thdpack.attention.backends.base import CallFacts
from thdpack.attention.heads import kv_replication
from thdpack.attention.merge import differentiable_attention
from thdpack.attention.placed import part_batch
from thdpack.attention.ring import RingPass, TileKernel
from thdpack.attention.select import BACKEND_TABLE
from thdpack.calibrate.kernels import timed_runs
from thdpack.cp.partition import shard
from thdpack.thd.batch import thd_collate, thd_to_device
from thdpack.thd.carriage import thd_meta
from thdpack.thd.meta import ThdMeta
from thdpack.thd.parts import shard_parts

MODES = ("te", "adaptive", "a2a", "a2a_adaptive")
SEED = 1234
ALPACA_MEAN = 78.0
"""Mean GPT-2 length of the Alpaca records (/work/shared/data): the synthetic stand-in's mean."""


class Unavailable(Exception):
    """No kernel for the comparison on this device; the message says why."""


@dataclass(frozen=True, kw_only=True)
class Case:
    """The sizes of one run of :func:`measure`."""

    pack_size: int
    cp_sizes: tuple[int, ...]
    sequences: int
    """How many sequences (the data's first) the plans pack."""
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    repeats: int

    def __post_init__(self) -> None:
        for cp in self.cp_sizes:
            if self.pack_size % (2 * cp) or self.heads % cp:
                raise ValueError(
                    f"cp {cp} needs pack_size a multiple of {2 * cp} and heads a multiple of {cp} (a2a), got "
                    f"pack_size={self.pack_size}, heads={self.heads}"
                )


GPU = Case(pack_size=8192, cp_sizes=(2, 4, 8), sequences=2048, heads=32, kv_heads=8, head_dim=128,
           dtype=torch.bfloat16, repeats=5)  # fmt: skip
"""Llama-3-8B attention (32 query, 8 KV heads of 128, bf16), L 8192, about 20 packs."""
TINY = Case(pack_size=512, cp_sizes=(2, 4), sequences=24, heads=4, kv_heads=2, head_dim=16,
            dtype=torch.float32, repeats=1)  # fmt: skip
"""CPU, exact math tiles, a few packs: seconds."""


class _Echoed:
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._tensors = tensors

    def wait(self) -> list[torch.Tensor]:
        return self._tensors


class EchoRing:
    """Rank ``rank`` of a ring of ``size`` whose peers are not there: ``send_recv`` hands back the
    tensors sent (the :class:`thdpack.cp.comm.Ring` interface; the module docstring says why the
    ring's tile work stays exactly the real one's)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def send_recv(self, tensors: Sequence[torch.Tensor]) -> _Echoed:
        return _Echoed(list(tensors))


def choose_backend(device: torch.device, case: Case) -> tuple[str, TileKernel]:
    """``(backend, ring tile kernel)``: on CUDA the first of ``flash`` / ``varlen`` that can run a
    placed shard (its kernel on whole sequences, thdpack's ring with FlashAttention-2 tiles on split
    ones), on the CPU ``math``; :class:`Unavailable` with every reason otherwise."""
    if device.type != "cuda":
        return "math", "math"
    facts = CallFacts(
        device=device, dtype=case.dtype, cp=True, cp_comm_type="p2p", need_lse=False, need_grad=True,
        head_dim=case.head_dim, head_dim_v=case.head_dim, capability=torch.cuda.get_device_capability(device),
        placed=True,
    )  # fmt: skip
    reasons = []
    for name in ("flash", "varlen"):
        row = BACKEND_TABLE[name]
        err = row.problem(facts)
        if err is None:
            algorithm = row.split_algorithm("p2p")
            assert algorithm == "ring_flash", f"{name} splits with {algorithm}"
            return name, "flash"
        reasons.append(f"{name}: {err}")
    raise Unavailable("no FlashAttention-2 backend for whole and split sequences: " + "; ".join(reasons))


def lengths_of_data(case: Case) -> tuple[str, np.ndarray]:
    """``(label, lengths)``: the first ``case.sequences`` Alpaca lengths (``cp_balance.ALPACA``,
    empty records left out), or where that file is absent a synthetic lognormal of Alpaca's mean."""
    if cp_balance.ALPACA.exists():
        lengths = np.load(cp_balance.ALPACA)
        return f"alpaca (first {case.sequences})", lengths[lengths > 0][: case.sequences].astype(np.int64)
    rng = np.random.default_rng(SEED)
    lengths = thd_bench.lognormal_lengths(rng, case.sequences, ALPACA_MEAN, case.pack_size)
    return f"synthetic lognormal, mean {ALPACA_MEAN:g} ({case.sequences}; no {cp_balance.ALPACA.name})", lengths


def _median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    # the warm-up run builds the record's caches (placements, part batches), as a step's first layer does
    return statistics.median(timed_runs(fn, device, repeats))


def _qkv(tokens: int, heads: int, kv_heads: int, case: Case, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Random q, k, v (requiring grad) and dout, ``(tokens, heads or kv_heads, H)``."""
    g = torch.Generator(device=device).manual_seed(SEED)

    def make(n: int, grad: bool) -> torch.Tensor:
        x = torch.randn(tokens, n, case.head_dim, generator=g, device=device, dtype=case.dtype)
        return x.requires_grad_(grad)

    return make(heads, True), make(kv_heads, True), make(kv_heads, True), make(heads, False)


def rank_attention(meta: ThdMeta, qkv: tuple[torch.Tensor, ...], backend: str, kernel: TileKernel) -> None:
    """Forward + backward of one CP rank's shard (record ``meta``), part by part as ``thd_attention``
    runs it, the ring's peers echoed (:class:`EchoRing`)."""
    q_TNH, k_TNH, v_TNH, dout_TNH = qkv
    scale = q_TNH.shape[-1] ** -0.5
    outs = []
    for index, part in enumerate(shard_parts(meta)):
        batch = part_batch(meta, index, q_TNH.device)
        q, k, v = q_TNH[part.rows], k_TNH[part.rows], v_TNH[part.rows]
        if part.group_size == 1:
            outs.append(thd_attention(q, k, v, batch, backend=backend))
            continue
        part_meta = batch["thd_meta"]
        ring = RingPass(EchoRing(part_meta.cp_rank, part.group_size), part_meta, True, scale, kernel)
        outs.append(differentiable_attention(q, k, v, ring)[0])
    out_TNH = outs[0] if len(outs) == 1 else torch.cat(outs)
    torch.autograd.grad(out_TNH, (q_TNH, k_TNH, v_TNH), dout_TNH)


def whole_attention(thd: dict[str, Any], qkv: tuple[torch.Tensor, ...], backend: str) -> None:
    """Forward + backward of the backend's kernel on a whole (unsharded) batch."""
    q_TNH, k_TNH, v_TNH, dout_TNH = qkv
    out_TNH = thd_attention(q_TNH, k_TNH, v_TNH, thd, backend=backend)
    torch.autograd.grad(out_TNH, (q_TNH, k_TNH, v_TNH), dout_TNH)


def _on_device(packs: list[dict[str, torch.Tensor]], device: torch.device) -> list[dict[str, Any]]:
    return [thd_to_device(thd_collate([pack]), device) for pack in packs]


def _summary(times_PR: np.ndarray) -> dict[str, float]:
    """(P, R) seconds per pack and rank -> ms of the busiest and the mean rank, summed over packs."""
    return {
        "packs": int(times_PR.shape[0]),
        "busiest_rank_ms": 1e3 * float(times_PR.max(axis=1).sum()),
        "mean_rank_ms": 1e3 * float(times_PR.mean(axis=1).sum()),
    }


def measure_cp(
    lengths: np.ndarray, cp_size: int, case: Case, device: torch.device, backend: str, kernel: TileKernel
) -> dict[str, dict[str, float]]:
    """Every mode's busiest-rank and mean-rank milliseconds for one CP size (module docstring)."""
    batches = {
        placement: _on_device(
            thd_bench.planned_packs(lengths, case.pack_size, cp_size, placement, overflow="split"), device
        )
        for placement in ("te", "adaptive")
    }
    local = _qkv(case.pack_size // cp_size, case.heads, case.kv_heads, case, device)
    out: dict[str, dict[str, float]] = {}
    for placement, thds in batches.items():
        times_PR = np.zeros((len(thds), cp_size))
        for p, thd in enumerate(thds):
            for rank in range(cp_size):
                meta = thd_meta(shard(thd, cp_size, rank))
                times_PR[p, rank] = _median_seconds(
                    lambda m=meta: rank_attention(m, local, backend, kernel), device, case.repeats
                )
        out[placement] = _summary(times_PR)
    # a2a: every rank attends all the batch's tokens with its Nq / cp query heads and their KV heads
    kv_heads = case.kv_heads * kv_replication(case.heads, case.kv_heads, cp_size) // cp_size
    heads = _qkv(case.pack_size, case.heads // cp_size, kv_heads, case, device)
    for mode, placement in (("a2a", "te"), ("a2a_adaptive", "adaptive")):
        seconds = [
            _median_seconds(lambda t=thd: whole_attention(t, heads, backend), device, case.repeats)
            for thd in batches[placement]
        ]
        out[mode] = _summary(np.asarray(seconds)[:, None])  # one column stands for every rank: equal work
    te = out["te"]["busiest_rank_ms"]
    for mode in MODES:
        out[mode]["vs_te"] = out[mode]["busiest_rank_ms"] / te
    return out


def measure(device: torch.device, tiny: bool, say: Callable[[str], None] = print) -> dict[str, Any]:
    """The section's record: the case, the backend and one row per (cp, mode)."""
    case = TINY if tiny else GPU
    backend, kernel = choose_backend(device, case)
    data, lengths = lengths_of_data(case)
    rows = []
    for cp_size in case.cp_sizes:
        start = time.perf_counter()
        for mode, m in measure_cp(lengths, cp_size, case, device, backend, kernel).items():
            rows.append({"data": data, "pack_size": case.pack_size, "cp_size": cp_size, "mode": mode, **m})
        say(f"   cp {cp_size}: {time.perf_counter() - start:.1f} s")
    return {
        "case": {
            "pack_size": case.pack_size,
            "sequences": len(lengths),
            "tokens": int(lengths.sum()),
            "heads": [case.heads, case.kv_heads, case.head_dim],
            "dtype": str(case.dtype).removeprefix("torch."),
            "repeats": case.repeats,
        },
        "backend": backend,
        "ring_tiles": kernel,
        "not_timed": (
            "communication: the ring's K/V and dK/dV transfers (overlapped with the tiles on real ranks) and "
            "a2a's four all-to-alls per layer (on its critical path); cp_balance.py counts their bytes"
        ),
        "rows": rows,
    }


def markdown(entry: dict[str, Any]) -> list[str]:
    """The section's table (gpu_suite's results.md)."""
    case = entry["case"]
    lines = [
        f"{case['sequences']} sequences ({case['tokens']:,} tokens), heads {case['heads'][0]} / {case['heads'][1]} x "
        f"{case['heads'][2]} {case['dtype']}, backend {entry['backend']} (ring tiles: {entry['ring_tiles']}), "
        f"forward + backward, median of {case['repeats']}; one pack per step, per pack the busiest rank, summed "
        f"over the packs. Not timed: {entry['not_timed']}.",
        "",
        "| data | L | cp | mode | packs | busiest-rank ms | mean-rank ms | busiest vs te |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in entry["rows"]:
        lines.append(
            f"| {row['data']} | {row['pack_size']} | {row['cp_size']} | {row['mode']} | {row['packs']} | "
            f"{row['busiest_rank_ms']:,.2f} | {row['mean_rank_ms']:,.2f} | {row['vs_te']:.3f} |"
        )
    return lines
