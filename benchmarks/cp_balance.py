"""Context-parallel load balance of causal attention on real packs: TE's layout vs the alternatives.

    python benchmarks/cp_balance.py                      # Alpaca L 8192, stdlib + long-tail mix L 32768; cp 2-16
    python benchmarks/cp_balance.py --lengths my.npy --pack-size 16384 --cp-sizes 4 8 --json out.json
    python benchmarks/cp_balance.py --tiny               # the first 3,000 sequences of each, seconds (the tests)
    python benchmarks/cp_balance.py --timing 1000000     # planner time, te vs adaptive, 1M web-like lengths

For every pack of a dataset's plan and every CP rank it counts, exactly:

- **pairs**: causal (query, key) pairs of real tokens whose query the rank owns: the work a
  perfect kernel does;
- **tiles**: FlashAttention-style kernel tiles of 128 query rows x 128 keys that the rank's
  kernels launch, per sequence (varlen kernels tile each sequence on its own), padding rows
  included, as the ring schedule runs them (``thdpack.plan.cp_cost``);
- **tokens**: the tokens of sequences the rank holds (activation memory; tail padding excluded).

Ways to place a pack's sequences on ``W = cp_size`` ranks (``te``, ``contiguous`` and
``documents`` share TE's packs; ``adaptive`` and ``a2a`` plan their own):

- ``te``: Transformer Engine's layout (``cp_placement="te"``): every sequence padded to a multiple
  of ``2W`` and cut into ``2W`` chunks, rank ``r`` holding chunks ``r`` and ``2W-1-r``. The ring
  runs at step 0 a causal (2c x 2c) tile per sequence and at each later step a full (2c x c) or
  (c x 2c) tile, ``c`` = chunk length;
- ``contiguous``: the pack (no CP padding) cut into ``W`` equal token ranges; a rank's queries meet
  the keys of every earlier range of their sequence;
- ``documents``: whole sequences dealt to ranks (longest-processing-time by causal tile cost), no
  sequence split: no communication, but memory follows the documents;
- ``adaptive``: ``plan_packs(..., cp_placement="adaptive")``: short sequences whole on one rank,
  longer ones split over a group of 1, 2, 4, ... or all ranks, chosen per pack
  (``thdpack.plan.adaptive``); ``adaptive_whole_or_all`` restricts the groups to whole or all
  ranks (what the intermediate group sizes add);
- ``a2a``: Ulysses all-to-all (``cp_comm_type: a2a``): packs of raw lengths (no CP padding); an
  all-to-all turns the sequence-sharded Q, K, V into full sequences of ``H / W`` heads, so every
  rank runs every sequence whole for ``1/W`` of the heads: its tiles and pairs are the pack's whole
  causal tiles and pairs divided by ``W``, the same on every rank. The all-to-all needs only equal
  tokens per rank, whatever the layout (``thdpack.attention.a2a``); these packs are what it costs on
  ``adaptive``-layout batches (CP padding only inside the few split sequences); on ``te``-layout
  batches the kernel also runs TE's CP padding, in ``te``'s packs.

Reported per dataset, pack size and cp_size, summed over the epoch's packs (a step waits for its
slowest rank): the busiest rank's tiles (``busiest_rank_tiles``: sum over packs of the max over
ranks) and pairs, relative to ``te``; max / mean over ranks of tiles and tokens (sum of the
per-pack max / sum of the per-pack mean); CP padding (padding inside split sequences' slots /
real tokens); the packs; and the bytes the busiest rank receives per layer and pack (mean over
packs; Llama-3-8B attention: 32 query and 8 KV heads of 128, bf16 activations):

- ring (``te``, ``adaptive``): only split sequences' K/V travel, around their group: a rank
  receives ``(g - 1) * slot / g`` tokens of each split sequence of its groups, ``te`` the whole
  local buffer (``L / W`` tokens, the tail padding included) of each of the ``W - 1`` others;
  per token: forward K/V (bf16), backward K/V again and the travelling dK/dV (fp32):
  ``2 * 8 * 128 * (2 + 2 + 4)`` bytes. A pack with no split sequence moves nothing;
- ``a2a``: two all-to-alls per layer forward (Q, K, V in; O out) and two backward (dO in; dQ, dK,
  dV out), each delivering ``(W - 1) / W`` of the rank's ``L / W`` tokens: per token
  ``(4 * 32 + 4 * lcm(8, W)) * 128 * 2`` bytes (bf16; the KV heads repeated up to ``lcm(8, W)``
  when ``W`` does not divide 8): ``thdpack.attention.a2a.a2a_bytes``, which the distributed tests
  check against the bytes the real collectives move.

``--timing N`` instead times ``plan_packs`` on N web-like lengths (``plan_bench.py``'s lognormal,
mean 800, clipped to 4096) with ``cp_placement="te"`` and ``"adaptive"`` (best of 5 each), and the
time inside the adaptive planner spent placing the long packs' templates (``place_packs``) and
checking packs against TE (``_repair``), each the best of the 5 plans.

GPU timings are not part of this script (it is CPU-only and exact by counting).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from thdpack.attention.a2a import a2a_bytes
from thdpack.layout.entries import rank_sums
from thdpack.layout.placement import CpPlacement
from thdpack.layout.rules import group_sizes, round_up_to_cp
from thdpack.plan import plan_packs
from thdpack.plan.adaptive import plan_adaptive
from thdpack.plan.cp_cost import TILE, causal_tiles, full_tiles, pairs_below, rank_costs, split_cost
from thdpack.plan.overflow import apply_overflow

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("THDPACK_SHARED_DATA", ROOT.parent / "shared" / "data"))
ALPACA = SHARED / "alpaca_data.gpt2.lengths.npy"
STDLIB = ROOT / "thdpack" / "assets" / "examples" / "python311_stdlib.gpt2.lengths.npy"
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
RING_BYTES_PER_TOKEN = 2 * KV_HEADS * HEAD_DIM * (2 + 2 + 4)
MODES = ("te", "contiguous", "documents", "adaptive", "adaptive_whole_or_all", "a2a")
TINY_SEQUENCES = 3000


def te_layout(real: np.ndarray, cp_size: int) -> dict[str, np.ndarray]:
    """(W,) pairs, tiles and tokens of one pack under TE's dual-chunk layout and ring schedule."""
    padded = round_up_to_cp(real, cp_size)
    return {
        "pairs": split_cost(real, padded, cp_size, "pairs").sum(0),
        "tiles": split_cost(real, padded, cp_size, "tiles").sum(0),
        "tokens": np.full(cp_size, int(padded.sum()) // cp_size, dtype=np.int64),
    }


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
    pairs += (pairs_below(hi) - pairs_below(lo)).sum(1)
    tiles += np.where(rows > 0, causal_tiles(rows), 0).sum(1)
    for source in range(cp_size):  # keys of the same sequence held by an earlier range
        earlier = np.arange(cp_size) > source
        tiles += np.where(earlier[:, None] & (rows > 0), full_tiles(rows, rows[source][None, :]), 0).sum(1)
    tokens = np.full(cp_size, width, dtype=np.int64)
    return {"pairs": pairs, "tiles": tiles, "tokens": tokens}


def document_placement(real: np.ndarray, cp_size: int) -> dict[str, np.ndarray]:
    """(W,) pairs, tiles and tokens when whole sequences are dealt to ranks, costliest first."""
    cost = causal_tiles(real)
    pairs = np.zeros(cp_size, dtype=np.int64)
    tiles = np.zeros(cp_size, dtype=np.int64)
    tokens = np.zeros(cp_size, dtype=np.int64)
    for i in np.argsort(-cost, kind="stable"):
        rank = int(np.argmin(tiles * (1 << 32) + tokens))  # least loaded, then fewest tokens
        tiles[rank] += cost[i]
        pairs[rank] += pairs_below(real[i])
        tokens[rank] += real[i]
    return {"pairs": pairs, "tiles": tiles, "tokens": tokens}


def ring_bytes(placement: CpPlacement) -> np.ndarray:
    """(P,) bytes the busiest rank of each pack receives per layer around its groups' rings."""
    split = placement.group_size > 1
    g = placement.group_size[split]
    remote = (g - 1) * placement.slots()[split] // g  # tokens of the sequence held by the others
    received_PR = rank_sums(
        placement.pack_of_entry()[split], remote, placement.group_start[split], g, len(placement), placement.cp_size
    )
    return received_PR.max(axis=1) * RING_BYTES_PER_TOKEN


def _summary(work: dict[str, np.ndarray], real_tokens: int, padded_tokens: int, packs: int) -> dict[str, float]:
    """Totals over packs of per-pack (P, W) pairs / tiles / tokens."""
    out: dict[str, float] = {"packs": packs, "cp_padding": padded_tokens / real_tokens - 1}
    for key in ("tiles", "pairs", "tokens"):
        busiest, mean = float(work[key].max(axis=1).sum()), float(work[key].mean(axis=1).sum())
        out[f"busiest_rank_{key}"] = busiest
        out[f"{key}_max_over_mean"] = busiest / mean if mean else 1.0
    busiest = np.argmax(work["tiles"], axis=1)
    rows = np.arange(len(busiest))
    useful = float(work["pairs"][rows, busiest].sum()) / (float(work["tiles"][rows, busiest].sum()) * TILE * TILE)
    out["useful_fraction_busiest"] = useful
    return out


def _placed(placement: CpPlacement) -> dict[str, np.ndarray]:
    return {
        "tiles": rank_costs(placement, "tiles"),
        "pairs": rank_costs(placement, "pairs"),
        "tokens": placement.rank_tokens(),
    }


def measure(lengths: np.ndarray, pack_size: int, cp_size: int) -> dict[str, object]:
    """Every mode's numbers for one dataset, pack size and cp_size."""
    row: dict[str, object] = {}
    te_plan = plan_packs(lengths, pack_size, cp_size=cp_size, overflow="split")
    entry_lengths = te_plan.entry_lengths_flat()
    real = int(entry_lengths.sum())
    te = CpPlacement.all_split(te_plan.offsets, entry_lengths, cp_size=cp_size, pack_size=pack_size)
    row["te"] = _summary(_placed(te), real, int(te.slots().sum()), len(te))
    # TE's ring moves the whole local buffer: its tail padding is the last sequence's padding
    row["te"]["kv_bytes_per_pack"] = float((cp_size - 1) * (pack_size // cp_size) * RING_BYTES_PER_TOKEN)
    per_pack = {"contiguous": [], "documents": []}
    for i in range(len(te_plan)):
        pack = te_plan.segments(i)[2]
        per_pack["contiguous"].append(contiguous_split(pack, pack_size, cp_size))
        per_pack["documents"].append(document_placement(pack, cp_size))
    for name, works in per_pack.items():
        work = {key: np.stack([w[key] for w in works]) for key in ("tiles", "pairs", "tokens")}
        row[name] = _summary(work, real, real, len(te_plan))
        row[name]["kv_bytes_per_pack"] = 0.0 if name == "documents" else float(row["te"]["kv_bytes_per_pack"])
    entries = apply_overflow(lengths, pack_size, "split").length
    for name, sizes in (("adaptive", None), ("adaptive_whole_or_all", (1, cp_size))):
        tick = time.perf_counter()
        plan = plan_adaptive(entries, pack_size, cp_size, fit="bfd", rng=None, cost_model="tiles", sizes=sizes)
        seconds = time.perf_counter() - tick
        placement = CpPlacement(cp_size=cp_size, pack_size=pack_size, offsets=plan.offsets,
                                lengths=entries[plan.ids], group_size=plan.group_size,
                                group_start=plan.group_start)  # fmt: skip
        placement.validate()
        row[name] = _summary(_placed(placement), real, int(placement.slots().sum()), len(placement))
        row[name]["kv_bytes_per_pack"] = float(ring_bytes(placement).mean())
        row[name]["plan_seconds"] = seconds
        row[name]["repaired_packs"] = plan.repaired_packs
        row[name]["te_packs_used"] = plan.te_packs
        row[name]["split_sequences"] = int((placement.group_size > 1).sum())
        row[name]["group_size_counts"] = {str(g): int((placement.group_size == g).sum()) for g in group_sizes(cp_size)}
    a2a_plan = plan_packs(lengths, pack_size, overflow="split")
    pack_E = np.repeat(np.arange(len(a2a_plan)), np.diff(a2a_plan.offsets))
    a2a_lengths = a2a_plan.entry_lengths_flat()
    work = {}
    for key, cost in (
        ("tiles", causal_tiles(a2a_lengths)),
        ("pairs", pairs_below(a2a_lengths)),
        ("tokens", a2a_lengths),
    ):
        per_pack_total = np.bincount(pack_E, weights=cost, minlength=len(a2a_plan))
        work[key] = np.repeat((per_pack_total / cp_size)[:, None], cp_size, axis=1)
    row["a2a"] = _summary(work, real, real, len(a2a_plan))
    row["a2a"]["kv_bytes_per_pack"] = float(a2a_bytes(pack_size // cp_size, cp_size, Q_HEADS, KV_HEADS, HEAD_DIM))
    te_tiles, te_pairs = row["te"]["busiest_rank_tiles"], row["te"]["busiest_rank_pairs"]
    te_bytes = row["te"]["kv_bytes_per_pack"] * row["te"]["packs"]
    for name in MODES:
        m = row[name]
        m["tiles_vs_te"] = m["busiest_rank_tiles"] / te_tiles
        m["pairs_vs_te"] = m["busiest_rank_pairs"] / te_pairs
        m["bytes_vs_te"] = m["kv_bytes_per_pack"] * m["packs"] / te_bytes
    return row


def _table(rows: list[dict[str, object]]) -> str:
    head = (
        "| data | L | cp | mode | busiest tiles vs te | busiest pairs vs te | tiles max/mean | tokens max/mean "
        "| CP padding | packs | MiB / layer / pack (busiest rank) |"
    )
    lines = [head, "|" + "---|" * 11]
    for row in rows:
        for name in MODES:
            m = row[name]
            lines.append(
                f"| {row['data']} | {row['pack_size']} | {row['cp_size']} | {name} | {m['tiles_vs_te']:.4f} | "
                f"{m['pairs_vs_te']:.3f} | {m['tiles_max_over_mean']:.3f} | {m['tokens_max_over_mean']:.3f} | "
                f"{100 * m['cp_padding']:.2f}% | {m['packs']:,} | {m['kv_bytes_per_pack'] / 2**20:.1f} |"
            )
    return "\n".join(lines)


def timing(n: int, configs: list[tuple[int, int]], repeats: int = 5) -> list[dict[str, object]]:
    """Seconds of plan_packs (te, adaptive) on n web-like lengths, and of the placement inside adaptive."""
    from plan_bench import make_lengths

    import thdpack.plan.adaptive as adaptive

    spent = {"place_packs": 0.0, "_repair": 0.0}

    def timed(name: str):
        inner = getattr(adaptive, name)

        def run(*args, **kwargs):
            tick = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - tick

        return inner, run

    lengths, _ = make_lengths("web", n)
    rows = []
    originals = {name: timed(name) for name in spent}
    try:
        for name, (_, run) in originals.items():
            setattr(adaptive, name, run)
        for pack_size, cp_size in configs:
            te = min(_seconds(lengths, pack_size, cp_size, "te") for _ in range(repeats))
            best = [np.inf, np.inf, np.inf]  # each the best of the repeats: a shared machine stalls at random
            for _ in range(repeats):
                spent.update(place_packs=0.0, _repair=0.0)
                plan_seconds = _seconds(lengths, pack_size, cp_size, "adaptive")
                best = [min(b, x) for b, x in zip(best, (plan_seconds, spent["place_packs"], spent["_repair"]),
                                                  strict=True)]  # fmt: skip
            row = {"n": n, "pack_size": pack_size, "cp_size": cp_size, "te_seconds": te, "adaptive_seconds": best[0],
                   "placement_seconds": best[1], "repair_seconds": best[2]}  # fmt: skip
            rows.append(row)
            print(
                f"n={n:,} L={pack_size} cp={cp_size}: plan_packs te {1e3 * te:.0f} ms, adaptive "
                f"{1e3 * best[0]:.0f} ms (placing templates {1e3 * best[1]:.0f} ms, checking packs "
                f"{1e3 * best[2]:.0f} ms)",
                flush=True,
            )
    finally:
        for name, (inner, _) in originals.items():
            setattr(adaptive, name, inner)
    return rows


def _seconds(lengths: np.ndarray, pack_size: int, cp_size: int, cp_placement: str) -> float:
    tick = time.perf_counter()
    plan_packs(lengths, pack_size, cp_size=cp_size, cp_placement=cp_placement)
    return time.perf_counter() - tick


def datasets(args: argparse.Namespace) -> list[tuple[str, np.ndarray, int]]:
    """(name, lengths, pack size) of every dataset to measure; empty sequences left out."""
    out = []
    if args.lengths is not None:
        path = args.lengths
        lengths = np.load(path) if path.suffix == ".npy" else np.loadtxt(path, dtype=np.int64, ndmin=1)
        out.append((path.name, np.asarray(lengths, dtype=np.int64), args.pack_size or 8192))
    else:
        stdlib = np.load(STDLIB)
        if ALPACA.exists():
            out.append(("alpaca (SFT records)", np.load(ALPACA), args.pack_size or 8192))
        else:
            print(f"skipping alpaca and the long-tail mix: {ALPACA} is absent (set THDPACK_SHARED_DATA)")
        out.append(("stdlib (long documents)", stdlib, args.pack_size or 32768))
        if ALPACA.exists():
            size = args.pack_size or 32768
            mix = np.concatenate((stdlib[stdlib <= size], np.load(ALPACA)))
            mix = mix[np.random.default_rng(0).permutation(len(mix))]  # interleaved (--tiny takes a prefix)
            out.append(("long-tail mix (stdlib files <= L + alpaca)", mix, size))
    trimmed = []
    for name, lengths, size in out:
        empty = int((lengths <= 0).sum())
        if empty:  # lengths files count records that tokenized to nothing; they have no attention work
            print(f"{name}: leaving out {empty} empty sequences of {len(lengths)}")
            lengths = lengths[lengths > 0]
        if args.tiny:
            lengths = lengths[:TINY_SEQUENCES]
        trimmed.append((name, lengths, size))
    return trimmed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack-size", type=int, default=None, help="L for every dataset (default: 8192 / 32768)")
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--lengths", type=Path, default=None, help="a .npy or .txt of lengths: measure it alone")
    parser.add_argument("--tiny", action="store_true", help=f"the first {TINY_SEQUENCES:,} sequences of each dataset")
    parser.add_argument("--timing", type=int, default=None, help="time the planners on this many lengths instead")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "cp_balance.json")
    args = parser.parse_args(argv)
    if args.timing:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        rows = timing(args.timing, [(32768, 8), (8192, 4)])
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"machine": platform.platform(), "timing": rows}, indent=1))
        return 0
    rows = []
    for data, lengths, pack_size in datasets(args):
        for cp_size in args.cp_sizes:
            tick = time.perf_counter()
            row = {"data": data, "pack_size": pack_size, "cp_size": cp_size, "sequences": len(lengths)}
            row.update(measure(lengths, pack_size, cp_size))
            row["seconds"] = time.perf_counter() - tick
            rows.append(row)
            print(f"{data}, L {pack_size}, cp {cp_size}: {row['seconds']:.1f} s", flush=True)
    print(_table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": platform.platform(), "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
