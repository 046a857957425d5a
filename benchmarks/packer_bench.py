"""Packer benchmark: streaming efficiency against offline BFD, and pack-building throughput.

    python benchmarks/packer_bench.py                   # ~2 min on 2 cores
    python benchmarks/packer_bench.py --quick           # smaller streams
    python benchmarks/packer_bench.py --json benchmarks/results/packer.json

Tables:
1. ``StreamingPacker`` (oldest-first, exact fill) at several buffer sizes vs the offline
   ``plan_packs(algorithm="bfd")`` on the same lengths: efficiency, packs / L2 lower bound and
   samples per second of the whole stream (validation, buffering, pack building).
2. ``PackedDataset``: seconds per pack built by ``ds[i]`` and per ``set_epoch`` re-plan, at
   pack_size 8192 (and 2048 for SFT lengths), with cp_size 1 and 4.

Length distributions are ``plan_bench.py``'s (the peers harness's), plus the real GPT-2 lengths
of Alpaca when ``../shared/data`` is present. Times are medians of repeats on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from plan_bench import make_lengths  # noqa: E402

from thdpack.packing.dataset import PackedDataset  # noqa: E402
from thdpack.packing.streaming import StreamingPacker  # noqa: E402
from thdpack.plan import plan_packs  # noqa: E402

ALPACA = HERE.parent.parent / "shared" / "data" / "alpaca_data.gpt2.lengths.npy"  # the project's ../shared


class TokenSamples:
    """Samples of the given lengths whose ids are views of one shared array (no per-sample allocation)."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths
        self.tokens = np.arange(1, int(lengths.max()) + 1, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[: self.lengths[i]]}

    def __iter__(self):
        for n in self.lengths:
            yield {"input_ids": self.tokens[:n]}


def datasets(n: int, alpaca_path: Path) -> list[tuple[str, np.ndarray, int]]:
    out = [(name, *make_lengths(name, n)) for name in ("web", "sft", "uniform")]
    if alpaca_path.exists():
        alpaca = np.load(alpaca_path).astype(np.int64)
        out.append(("alpaca (gpt2)", alpaca[alpaca > 0], 2048))
    return out


def bench_streaming(n: int, buffers: list[int], alpaca_path: Path) -> list[dict]:
    rows = []
    for name, lengths, pack_size in datasets(n, alpaca_path):
        offline = plan_packs(lengths, pack_size, algorithm="bfd").stats
        rows.append(
            {
                "data": name,
                "n": len(lengths),
                "pack_size": pack_size,
                "packer": "offline bfd (plan_packs)",
                "efficiency": offline.efficiency,
                "packs_over_l2": offline.packs_over_lower_bound,
                "samples_per_s": None,
            }
        )
        for buffer_size in buffers:
            packer = StreamingPacker(TokenSamples(lengths), pack_size, buffer_size=buffer_size)
            start = time.perf_counter()
            for _ in packer:
                pass
            seconds = time.perf_counter() - start
            stats = packer.stats
            rows.append(
                {
                    "data": name,
                    "n": len(lengths),
                    "pack_size": pack_size,
                    "packer": f"streaming, buffer {buffer_size}",
                    "efficiency": stats.efficiency,
                    "packs_over_l2": stats.packs_over_lower_bound,
                    "samples_per_s": len(lengths) / seconds,
                }
            )
    return rows


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_dataset(n: int) -> list[dict]:
    rows = []
    for name, pack_size in (("web", 8192), ("sft", 2048)):
        lengths, _ = make_lengths(name, n)
        samples = TokenSamples(lengths)
        for cp_size in (1, 4):
            ds = PackedDataset(samples, pack_size, cp_size=cp_size, lengths=lengths)
            k = min(200, len(ds))
            per_pack = median_seconds(lambda ds=ds, k=k: [ds[i] for i in range(k)], 3) / k
            epoch = iter(range(1, 100))
            replan = median_seconds(lambda ds=ds, epoch=epoch: (ds.set_epoch(next(epoch)), len(ds)), 3)
            rows.append(
                {
                    "data": name,
                    "n": n,
                    "pack_size": pack_size,
                    "cp_size": cp_size,
                    "packs": len(ds),
                    "ms_per_pack": 1e3 * per_pack,
                    "tokens_per_s": pack_size / per_pack,
                    "replan_s": replan,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="20k-sample streams, 100k-sample datasets")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--alpaca", type=Path, default=ALPACA, help="GPT-2 lengths of Alpaca (.npy); skipped if absent")
    args = parser.parse_args()
    n_stream, n_ds = (20_000, 100_000) if args.quick else (100_000, 1_000_000)
    stream = bench_streaming(n_stream, [64, 256, 1024, 4096], args.alpaca)
    print(f"\nStreaming vs offline ({platform.processor() or platform.machine()}, {n_stream:,} samples per stream)")
    print(f"{'data':<14} {'packer':<26} {'efficiency':>10} {'packs/L2':>9} {'samples/s':>10}")
    for r in stream:
        rate = "" if r["samples_per_s"] is None else f"{r['samples_per_s']:,.0f}"
        print(f"{r['data']:<14} {r['packer']:<26} {100 * r['efficiency']:>9.3f}% {r['packs_over_l2']:>9.5f} {rate:>10}")
    dataset = bench_dataset(n_ds)
    print(f"\nPackedDataset ({n_ds:,} sequences, bfd)")
    print(f"{'data':<6} {'pack':>6} {'cp':>3} {'packs':>9} {'ms/pack':>8} {'tokens/s':>12} {'re-plan s':>10}")
    for r in dataset:
        print(
            f"{r['data']:<6} {r['pack_size']:>6} {r['cp_size']:>3} {r['packs']:>9,} {r['ms_per_pack']:>8.3f} "
            f"{r['tokens_per_s']:>12,.0f} {r['replan_s']:>10.3f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"streaming": stream, "packed_dataset": dataset}, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
