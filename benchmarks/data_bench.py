"""Data pipeline throughput: read, tokenize, store write, verify, random-access read; peak memory.

    python benchmarks/data_bench.py                                # the embedded stdlib corpus
    python benchmarks/data_bench.py --input ../shared/data/alpaca_data.json --json out.json

Prints a table (one row per stage) and writes the rows as JSON with ``--json PATH``.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from thdpack.data.encode import SampleEncoder, TokenizeConfig, record_batches
from thdpack.data.sources import Source
from thdpack.data.store import TokenStore, TokenStoreWriter
from thdpack.data.store_verify import verify_store


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", default="stdlib", help="any `thdpack prepare` input (default: stdlib)")
    parser.add_argument("--batch-size", type=int, default=512, help="records per tokenizer call")
    parser.add_argument("--reads", type=int, default=20000, help="random store accesses to time")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()

    rows = []
    source = Source(args.input)
    start = time.perf_counter()
    records = list(source)
    seconds = time.perf_counter() - start
    chars = sum(len(str(r.get("text", r))) for r in records)
    rows.append(
        {
            "stage": "read",
            "seconds": seconds,
            "items": len(records),
            "rate": len(records) / seconds,
            "unit": "records/s",
            "note": f"{chars / seconds / 1e6:.1f} M chars/s, {source.report}",
        }
    )

    encoder = SampleEncoder("gpt2", TokenizeConfig(batch_size=args.batch_size))
    start = time.perf_counter()
    samples = []
    batches = ((batch, None) for batch in record_batches(records, encoder.config))  # as `thdpack prepare`
    for batch_samples in encoder.encode_stream(batches):
        samples.extend(batch_samples)
    seconds = time.perf_counter() - start
    tokens = encoder.report.tokens
    rows.append(
        {
            "stage": "tokenize",
            "seconds": seconds,
            "items": tokens,
            "rate": tokens / seconds,
            "unit": "tokens/s",
            "note": f"batches of <= {args.batch_size} records / {encoder.config.batch_chars:,} chars",
        }
    )

    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        with TokenStoreWriter(folder, tokenizer=encoder.tokenizer) as writer:
            writer.add_all(samples)
        seconds = time.perf_counter() - start
        rows.append(
            {
                "stage": "store write",
                "seconds": seconds,
                "items": tokens,
                "rate": tokens / seconds,
                "unit": "tokens/s",
                "note": f"{writer.dtype.name}",
            }
        )
        checked = verify_store(folder)
        rows.append(
            {
                "stage": "store verify",
                "seconds": checked.seconds,
                "items": checked.bytes_read,
                "rate": checked.bytes_read / checked.seconds,
                "unit": "bytes/s",
                "note": "sha256 of every file, token ids, offsets (before training)",
            }
        )
        store = TokenStore(folder)
        start = time.perf_counter()
        lengths = store.lengths
        seconds = time.perf_counter() - start
        rows.append(
            {
                "stage": "store lengths",
                "seconds": seconds,
                "items": len(lengths),
                "rate": len(lengths) / seconds,
                "unit": "samples/s",
                "note": "offsets only",
            }
        )
        order = np.random.default_rng(0).integers(0, len(store), args.reads)
        start = time.perf_counter()
        read_tokens = sum(len(store[int(i)]["input_ids"]) for i in order)
        seconds = time.perf_counter() - start
        rows.append(
            {
                "stage": "store random read",
                "seconds": seconds,
                "items": args.reads,
                "rate": args.reads / seconds,
                "unit": "samples/s",
                "note": f"{read_tokens / seconds / 1e6:.1f} M tokens/s",
            }
        )

    print(f"input: {args.input}; python {platform.python_version()}; peak RSS {peak_rss_mib():,.0f} MiB\n")
    print("| stage | seconds | items | rate | note |\n|---|---|---|---|---|")
    for r in rows:
        rate = f"{r['rate']:,.0f} {r['unit']}"
        print(f"| {r['stage']} | {r['seconds']:.2f} | {r['items']:,} | {rate} | {r['note']} |")
    if args.json:
        args.json.write_text(json.dumps({"input": args.input, "peak_rss_mib": peak_rss_mib(), "rows": rows}, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
