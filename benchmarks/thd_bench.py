"""THD batch benchmark: collate -> to_thd -> cp.shard on a realistic batch, and partition_indices at scale.

    python benchmarks/thd_bench.py                         # CPU (and CUDA when present)
    python benchmarks/thd_bench.py --json benchmarks/results/thd_bench.json
    python benchmarks/thd_bench.py --reps 2000 --threads 2

Stage times are the median of ``--reps`` repetitions (p10 / p90 alongside; the machine is
shared and noisy). By default torch runs on one thread, as it does in a DataLoader worker,
where ``thd_collate`` and ``shard`` run. Targets (DESIGN.md): collate + to_thd + shard of
8 packs x 8192 tokens <= 1 ms on CPU; partition_indices of 1M tokens <= 1 ms on an H100.

The same stages also run on packs planned by ``plan_packs`` over one set of lognormal lengths,
once in TE's layout and once with ``cp_placement="adaptive"`` (short sequences whole on one rank,
one padding entry per rank, the groups validated per pack, the placement's shard order); the
``adaptive / te`` row is the ratio of the two sums (issue 16: within 1.5x).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from thdpack._optional import has_transformer_engine
from thdpack.cp import partition_indices, shard
from thdpack.packing.packer import pack_from_segments
from thdpack.plan import plan_packs
from thdpack.thd import collate, thd_collate, to_thd

SEED = 1234
TARGET_BATCH_US = 1000.0
TARGET_PARTITION_CUDA_US = 1000.0
TARGET_ADAPTIVE_RATIO = 1500.0
"""Issue 16: collate + to_thd + shard of an adaptive placement's packs within 1.5x of TE's (x 1000)."""


def lognormal_lengths(rng: np.random.Generator, n: int, mean: float, cap: int) -> np.ndarray:
    """Web-text-like lengths: lognormal(mean, sigma 1.0) clipped to [1, cap]."""
    x = rng.lognormal(math.log(mean) - 0.5, 1.0, n)
    return np.clip(np.rint(x), 1, cap).astype(np.int64)


def make_packs(num_packs: int, pack_size: int, cp_size: int, seed: int = SEED) -> list[dict[str, torch.Tensor]]:
    """``num_packs`` full packs in CONTRACT.md's format, first-fit over lognormal lengths."""
    rng = np.random.default_rng(seed)
    step = 2 * cp_size if cp_size > 1 else 1
    lengths = lognormal_lengths(rng, 20 * num_packs * pack_size // 800, 800.0, pack_size)
    free = [pack_size] * num_packs
    members: list[list[int]] = [[] for _ in range(num_packs)]
    for n in lengths.tolist():
        width = -(-n // step) * step
        for p in range(num_packs):
            if free[p] >= width:
                free[p] -= width
                members[p].append(n)
                break
        if max(free) < step:
            break
    packs = []
    for seqs in members:
        widths = [-(-n // step) * step for n in seqs]
        widths[-1] += pack_size - sum(widths)
        real = torch.cat([torch.arange(w) < n for n, w in zip(seqs, widths, strict=True)])
        input_ids = torch.where(real, torch.from_numpy(rng.integers(1, 50000, pack_size)), 0)
        packs.append(
            {
                "input_ids": input_ids,
                "labels": torch.where(real, input_ids, -100),
                "position_ids": torch.cat([torch.arange(w) for w in widths]),
                "seq_lens": torch.tensor(seqs),
                "seq_lens_padded": torch.tensor(widths),
            }
        )
    return packs


def make_planned_packs(
    num_packs: int, pack_size: int, cp_size: int, cp_placement: str, seed: int = SEED
) -> list[dict[str, torch.Tensor]]:
    """``num_packs`` packs of ``plan_packs(..., cp_placement=...)`` over lognormal lengths (evenly
    spaced over the plan, which lists packs largest sequence first), built by the packer: the
    same lengths and the same choice of packs for ``"te"`` and ``"adaptive"``."""
    rng = np.random.default_rng(seed)
    lengths = lognormal_lengths(rng, 20 * num_packs * pack_size // 800, 800.0, pack_size)
    return planned_packs(lengths, pack_size, cp_size, cp_placement, num_packs=num_packs)


def planned_packs(
    lengths: np.ndarray,
    pack_size: int,
    cp_size: int,
    cp_placement: str,
    *,
    num_packs: int | None = None,
    overflow: str = "error",
) -> list[dict[str, torch.Tensor]]:
    """The packs of ``plan_packs(lengths, ..., cp_placement=..., overflow=...)`` built by the packer
    (samples of token ids ``1..n``): every pack, or ``num_packs`` evenly spaced over the plan."""
    plan = plan_packs(lengths, pack_size, cp_size=cp_size, cp_placement=cp_placement, overflow=overflow)
    samples = [{"input_ids": np.arange(1, n + 1)} for n in np.asarray(lengths).tolist()]
    if num_packs is None:
        chosen = list(range(len(plan)))
    else:
        chosen = np.linspace(0, len(plan) - 1, num_packs).round().astype(int).tolist()
    placement = plan.placement
    return [
        dict(
            pack_from_segments(
                samples, plan.segments(i), pack_size, cp_size=cp_size,
                placement=None if placement is None else placement.pack(i),
            )
        )
        for i in chosen
    ]  # fmt: skip


def time_cpu(fn: Callable[[], object], reps: int) -> dict[str, float]:
    for _ in range(min(20, reps)):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return _summary(samples)


def time_cuda(fn: Callable[[], object], reps: int) -> dict[str, float]:
    for _ in range(min(20, reps)):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return _summary(samples)


def _summary(samples_us: list[float]) -> dict[str, float]:
    a = np.asarray(samples_us)
    return {
        "median_us": float(np.median(a)),
        "p10_us": float(np.percentile(a, 10)),
        "p90_us": float(np.percentile(a, 90)),
    }


def partition_case(num_tokens: int, num_seqs: int, cp_size: int, seed: int = SEED) -> torch.Tensor:
    """(N+1,) int32 cu_seqlens_padded of ``num_seqs`` lognormal slots, multiples of 2*cp_size."""
    rng = np.random.default_rng(seed)
    step = 2 * cp_size
    weights = rng.lognormal(0.0, 1.0, num_seqs)
    chunks = 1 + rng.multinomial(num_tokens // step - num_seqs, weights / weights.sum())
    cu = np.concatenate([[0], np.cumsum(chunks * step)])
    return torch.from_numpy(cu.astype(np.int32))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packs", type=int, default=8, help="packs per batch (B)")
    parser.add_argument("--pack-size", type=int, default=8192, help="tokens per pack (L)")
    parser.add_argument("--cp-size", type=int, default=2, help="context-parallel size for shard")
    parser.add_argument("--reps", type=int, default=500, help="repetitions per stage (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 = a DataLoader worker)")
    parser.add_argument("--partition-tokens", type=int, default=1 << 20, help="tokens for partition_indices")
    parser.add_argument("--partition-seqs", type=int, default=10_000, help="sequences for partition_indices")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    packs = make_packs(args.packs, args.pack_size, args.cp_size)
    batch = collate(packs)
    thd = to_thd(batch)
    num_seqs = int(thd["cu_seqlens"].numel() - 1)
    rows: list[tuple[str, dict[str, float], float | None]] = []
    stages = {
        "collate": lambda: collate(packs),
        "to_thd": lambda: to_thd(batch),
        f"shard (cp_size={args.cp_size}, rank 0)": lambda: shard(thd, args.cp_size, 0),
        "thd_collate + shard (the worker's path)": lambda: shard(thd_collate(packs), args.cp_size, 0),
    }
    for name, fn in stages.items():
        rows.append((name, time_cpu(fn, args.reps), None))
    total = sum(r[1]["median_us"] for r in rows[:3])
    rows.append(("collate + to_thd + shard (sum of medians)", {"median_us": total}, TARGET_BATCH_US))
    if args.cp_size > 1:  # the same lengths planned in TE's layout and in an adaptive placement
        sums = {}
        for mode in ("te", "adaptive"):
            packs_m = make_planned_packs(args.packs, args.pack_size, args.cp_size, mode)
            batch_m = collate(packs_m)
            thd_m = to_thd(batch_m)
            entries = int(thd_m["cu_seqlens"].numel() - 1)
            planned = {
                f"{mode} plan ({entries} entries): collate": lambda p=packs_m: collate(p),
                f"{mode} plan: to_thd": lambda b=batch_m: to_thd(b),
                f"{mode} plan: shard (rank 0)": lambda t=thd_m: shard(t, args.cp_size, 0),
            }
            first = len(rows)
            for name, fn in planned.items():
                rows.append((name, time_cpu(fn, args.reps), None))
            sums[mode] = sum(r[1]["median_us"] for r in rows[first:])
            rows.append((f"{mode} plan: collate + to_thd + shard (sum of medians)", {"median_us": sums[mode]}, None))
        ratio = 1000 * sums["adaptive"] / sums["te"]
        rows.append(("adaptive / te, collate + to_thd + shard (x 1000)", {"median_us": ratio}, TARGET_ADAPTIVE_RATIO))

    cu = partition_case(args.partition_tokens, args.partition_seqs, args.cp_size)
    T = int(cu[-1])
    part_name = f"partition_indices, {T:,} tokens, {args.partition_seqs:,} seqs, cp {args.cp_size}"
    rows.append((f"{part_name}, CPU", time_cpu(lambda: partition_indices(cu, T, args.cp_size, 0), 50), None))
    if torch.cuda.is_available():
        cu_cuda = cu.cuda()
        rows.append(
            (
                f"{part_name}, CUDA, computed on the host",
                time_cuda(lambda: partition_indices(cu_cuda, T, args.cp_size, 0, impl="numpy"), 200),
                TARGET_PARTITION_CUDA_US,
            )
        )
        if has_transformer_engine():
            rows.append(
                (
                    f"{part_name}, CUDA Transformer Engine",
                    time_cuda(lambda: partition_indices(cu_cuda, T, args.cp_size, 0, impl="te"), 200),
                    TARGET_PARTITION_CUDA_US,
                )
            )
    else:
        rows.append((f"{part_name}, CUDA", {}, TARGET_PARTITION_CUDA_US))

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    print(
        f"batch: {args.packs} packs x {args.pack_size} tokens, {num_seqs} sequences, cp_size {args.cp_size}; "
        f"torch {torch.__version__}, {args.threads} thread(s), {platform.processor() or platform.machine()}, "
        f"{device}"
    )
    print(f"{'stage':<72} {'median us':>10} {'p10':>8} {'p90':>8} {'target':>8}")
    for name, stats, target in rows:
        if not stats:
            print(f"{name:<72} {'skipped (no CUDA)':>10}")
            continue
        median = f"{stats['median_us']:10.1f}"
        p10 = f"{stats['p10_us']:8.1f}" if "p10_us" in stats else " " * 8
        p90 = f"{stats['p90_us']:8.1f}" if "p90_us" in stats else " " * 8
        verdict = "" if target is None else f"{target:6.0f} {'ok' if stats['median_us'] <= target else 'MISS'}"
        print(f"{name:<72} {median} {p10} {p90} {verdict}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "num_sequences": num_seqs,
            "torch": torch.__version__,
            "device": device,
            "rows": [{"stage": n, **s, "target_us": t} for n, s, t in rows],
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
