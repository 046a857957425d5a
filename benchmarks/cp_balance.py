"""Context-parallel load balance of causal attention on real packs: TE's layout vs the alternatives.

    python benchmarks/cp_balance.py                      # Alpaca (SFT) + stdlib (long documents), L 8192
    python benchmarks/cp_balance.py --pack-size 4096 --cp-sizes 2 4 8 --json out.json
    python benchmarks/cp_balance.py --tiny               # a few packs, seconds (the tests run this)

For every pack of a dataset's plan and every CP rank it counts, exactly:

- **pairs**: causal (query, key) pairs of real tokens whose query the rank owns: the work a
  perfect kernel does;
- **tiles**: FlashAttention-style kernel tiles of 128 query rows x 128 keys that the rank's
  kernels launch, per sequence (varlen kernels tile each sequence on its own), padding rows
  included, as the ring schedule runs them;
- **tokens**: the tokens the rank holds (activation memory).

Three ways to place a pack's sequences on ``W = cp_size`` ranks:

- ``te``: Transformer Engine's layout (what thdpack shards): every sequence padded to a multiple of
  ``2W`` and cut into ``2W`` chunks, rank ``r`` holding chunks ``r`` and ``2W-1-r``. The ring
  (TE's schedule, ``thdpack.attention.ring``) runs at step 0 a causal (2c x 2c) tile per sequence
  and at each later step a full (2c x c) or (c x 2c) tile, ``c`` = chunk length;
- ``contiguous``: the pack (no CP padding) cut into ``W`` equal token ranges; a rank's queries meet
  the keys of every earlier range of their sequence;
- ``documents``: whole sequences dealt to ranks (longest-processing-time by causal tile cost), no
  sequence split: no communication, but memory follows the documents.

Reported per dataset, pack size and cp_size: max / mean over ranks of pairs and of tiles (summed
over the epoch's packs, as a step's ranks wait for the slowest), the useful fraction of the
busiest rank's tile work (pairs / (tiles x 128 x 128)), TE's CP padding overhead, and the K/V bytes
a rank receives per layer and pack in the ring and in the all-gather variant (forward + backward,
Llama-3-8B attention: 8 KV heads x 128, bf16; the backward's dK/dV travel in fp32).
GPU timings of the ring are not part of this script (it is CPU-only and exact by counting).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from thdpack.format_rules import round_up_to_cp
from thdpack.plan import plan_packs

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
DATASETS = {
    "alpaca (SFT records)": SHARED / "alpaca_data.gpt2.lengths.npy",
    "stdlib (long documents)": ROOT / "thdpack" / "assets" / "examples" / "python311_stdlib.gpt2.lengths.npy",
}
TILE = 128
KV_HEADS, HEAD_DIM, KV_BYTES, GRAD_BYTES = 8, 128, 2, 4


def _tiles(rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Kernel tiles of full (rows x cols) attention blocks, elementwise."""
    return -(-rows // TILE) * (-(-cols // TILE))


def _causal_tiles(n: np.ndarray) -> np.ndarray:
    """Kernel tiles of a causal (n x n) block: the lower block triangle."""
    blocks = -(-n // TILE)
    return blocks * (blocks + 1) // 2


def _pairs_below(x: np.ndarray) -> np.ndarray:
    """Causal pairs of the queries at positions ``0 .. x-1`` of one sequence: sum of (p + 1)."""
    return x * (x + 1) // 2


def te_layout(real: np.ndarray, cp_size: int) -> dict[str, np.ndarray]:
    """(W,) pairs, tiles and tokens of one pack under TE's dual-chunk layout and ring schedule."""
    padded = round_up_to_cp(real, cp_size)
    chunk = padded // (2 * cp_size)
    ranks = np.arange(cp_size)[:, None]
    pairs = np.zeros(cp_size, dtype=np.int64)
    for first in (ranks * chunk, (2 * cp_size - 1 - ranks) * chunk):  # chunk r, then chunk 2W-1-r
        start, stop = np.minimum(first, real), np.minimum(first + chunk, real)
        pairs += (_pairs_below(stop) - _pairs_below(start)).sum(1)
    # step 0: causal over the 2c local rows; each of the W-1 later steps: (2c x c) or (c x 2c)
    per_sequence = _causal_tiles(2 * chunk) + (cp_size - 1) * _tiles(2 * chunk, chunk)
    tiles = np.full(cp_size, int(per_sequence.sum()), dtype=np.int64)
    tokens = np.full(cp_size, int(padded.sum()) // cp_size, dtype=np.int64)
    return {"pairs": pairs, "tiles": tiles, "tokens": tokens}


def contiguous_split(real: np.ndarray, pack_size: int, cp_size: int) -> dict[str, np.ndarray]:
    """(W,) pairs, tiles and tokens when the pack's tokens (no CP padding) are cut into W ranges."""
    width = pack_size // cp_size
    starts = np.cumsum(real) - real
    pairs = np.zeros(cp_size, dtype=np.int64)
    tiles = np.zeros(cp_size, dtype=np.int64)
    # the part of each sequence that range r holds, as positions [lo, hi) inside the sequence
    lo = np.clip(np.arange(cp_size)[:, None] * width - starts, 0, real)
    hi = np.clip((np.arange(cp_size)[:, None] + 1) * width - starts, 0, real)
    rows = hi - lo
    pairs += (_pairs_below(hi) - _pairs_below(lo)).sum(1)
    tiles += np.where(rows > 0, _causal_tiles(rows), 0).sum(1)
    for source in range(cp_size):  # keys of the same sequence held by an earlier range
        earlier = np.arange(cp_size) > source
        tiles += np.where(earlier[:, None] & (rows > 0), _tiles(rows, rows[source][None, :]), 0).sum(1)
    tokens = np.full(cp_size, width, dtype=np.int64)
    return {"pairs": pairs, "tiles": tiles, "tokens": tokens}


def document_placement(real: np.ndarray, cp_size: int) -> dict[str, np.ndarray]:
    """(W,) pairs, tiles and tokens when whole sequences are dealt to ranks, costliest first."""
    cost = _causal_tiles(real)
    pairs = np.zeros(cp_size, dtype=np.int64)
    tiles = np.zeros(cp_size, dtype=np.int64)
    tokens = np.zeros(cp_size, dtype=np.int64)
    for i in np.argsort(-cost, kind="stable"):
        rank = int(np.argmin(tiles * (1 << 32) + tokens))  # least loaded, then fewest tokens
        tiles[rank] += cost[i]
        pairs[rank] += _pairs_below(real[i])
        tokens[rank] += real[i]
    return {"pairs": pairs, "tiles": tiles, "tokens": tokens}


def kv_bytes(pack_size: int, cp_size: int) -> dict[str, int]:
    """K/V bytes a rank receives per layer and pack: ring (forward, backward: K/V again and the
    travelling dK/dV) vs all-gather (forward gather, backward reduce-scatter of dK/dV)."""
    remote_tokens = (cp_size - 1) * pack_size // cp_size
    kv = remote_tokens * 2 * KV_HEADS * HEAD_DIM * KV_BYTES
    dkv = remote_tokens * 2 * KV_HEADS * HEAD_DIM * GRAD_BYTES
    return {"ring": 2 * kv + dkv, "all_gather": kv + dkv}


def measure(lengths: np.ndarray, pack_size: int, cp_size: int, max_packs: int | None) -> dict[str, object]:
    plan = plan_packs(lengths, pack_size, cp_size=cp_size, overflow="split")
    count = len(plan) if max_packs is None else min(max_packs, len(plan))
    totals = {name: {key: np.zeros(cp_size, dtype=np.int64) for key in ("pairs", "tiles", "tokens")}
              for name in ("te", "contiguous", "documents")}  # fmt: skip
    real_tokens = padded_tokens = 0
    for i in range(count):
        real = plan.segments(i)[2].astype(np.int64)
        real_tokens += int(real.sum())
        padded_tokens += int(round_up_to_cp(real, cp_size).sum())
        for name, work in (
            ("te", te_layout(real, cp_size)),
            ("contiguous", contiguous_split(real, pack_size, cp_size)),
            ("documents", document_placement(real, cp_size)),
        ):
            for key in work:
                totals[name][key] += work[key]
    result: dict[str, object] = {
        "packs": count,
        "cp_padding": padded_tokens / real_tokens - 1,
        "kv_bytes": kv_bytes(pack_size, cp_size),
    }
    for name, work in totals.items():
        busiest = int(np.argmax(work["tiles"]))
        result[name] = {
            "pairs_max_over_mean": float(work["pairs"].max() / work["pairs"].mean()),
            "tiles_max_over_mean": float(work["tiles"].max() / work["tiles"].mean()),
            "tokens_max_over_mean": float(work["tokens"].max() / work["tokens"].mean()),
            "useful_fraction_busiest": float(work["pairs"][busiest] / (work["tiles"][busiest] * TILE * TILE)),
        }
    return result


def _table(rows: list[dict[str, object]]) -> str:
    head = (
        "| data | L | cp | layout | pairs max/mean | tiles max/mean | tokens max/mean | useful tiles (busiest) "
        "| CP padding | K/V MiB ring / all-gather |"
    )
    lines = [head, "|" + "---|" * 10]
    for row in rows:
        for name in ("te", "contiguous", "documents"):
            m = row[name]
            extra = (
                f"{100 * row['cp_padding']:.1f}% | {row['kv_bytes']['ring'] / 2**20:.1f} / "
                f"{row['kv_bytes']['all_gather'] / 2**20:.1f}"
                if name == "te"
                else "| "
            )
            lines.append(
                f"| {row['data']} | {row['pack_size']} | {row['cp_size']} | {name} | {m['pairs_max_over_mean']:.3f} | "
                f"{m['tiles_max_over_mean']:.3f} | {m['tokens_max_over_mean']:.3f} | "
                f"{100 * m['useful_fraction_busiest']:.1f}% | {extra} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack-size", type=int, nargs="+", default=[8192])
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--max-packs", type=int, default=None, help="only the first N packs of each plan")
    parser.add_argument("--tiny", action="store_true", help="a few packs of each dataset (seconds; the tests)")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "cp_balance.json")
    args = parser.parse_args(argv)
    max_packs = 8 if args.tiny else args.max_packs
    rows = []
    for data, path in DATASETS.items():
        if not path.exists():
            print(f"skipping {data}: {path} is absent (only the project's own checkout has ../shared)")
            continue
        lengths = np.load(path)
        empty = int((lengths == 0).sum())
        if empty:  # lengths files count records that tokenized to nothing; they have no attention work
            print(f"{data}: leaving out {empty} empty sequences of {len(lengths)}")
            lengths = lengths[lengths > 0]
        for pack_size in args.pack_size:
            for cp_size in args.cp_sizes:
                tick = time.perf_counter()
                row = {"data": data, "pack_size": pack_size, "cp_size": cp_size}
                row.update(measure(lengths, pack_size, cp_size, max_packs))
                row["seconds"] = time.perf_counter() - tick
                rows.append(row)
    print(_table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": platform.platform(), "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
