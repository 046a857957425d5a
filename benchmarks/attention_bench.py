"""Attention benchmark: backend timings on packed SFT-like batches, and bf16 accuracy on CUDA.

    python benchmarks/attention_bench.py                         # CPU: math vs sdpa vs flex
    python benchmarks/attention_bench.py --pack-sizes 1024 4096 --repeats 5 --json out.json
    python benchmarks/attention_bench.py --device cuda            # + bf16 error vs fp32 reference

CPU rows time forward and forward+backward of ``thd_attention`` (flex has no CPU backward in
torch >= 2.11: its backward column says so). On CUDA every available backend, and thdpack's ring
with FlashAttention-2 tiles simulated on one GPU for cp 2 and 4, is also measured for accuracy:
max |error| of out / dq / dk / dv in bf16 against an fp32 reference, next to the error of plain
PyTorch bf16 attention (the issue's criterion: no worse than 2x plain bf16). Timings are the
best of ``--repeats`` runs after one warm-up; the machine may be shared, so compare within a run.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from thdpack.attention import reference_attention, thd_attention  # noqa: E402
from thdpack.attention.ring_simulation import simulated_ring_attention  # noqa: E402

SEED = 1234


def sft_lengths(pack_size: int, multiple: int, seed: int) -> list[int]:
    """Real lengths of one pack: lognormal(mean ~250, sigma 1) SFT samples, packed in order until full."""
    g = torch.Generator().manual_seed(seed)
    lengths, used = [], 0
    while True:
        n = int(torch.empty(1).log_normal_(5.5, 1.0, generator=g).clamp(1, pack_size))
        slot = -(-n // multiple) * multiple
        if used + slot > pack_size:
            break
        lengths.append(n)
        used += slot
    return lengths or [pack_size]


def make_batch(pack_size: int, multiple: int, seed: int) -> dict:
    lengths = sft_lengths(pack_size, multiple, seed)
    slots = [-(-n // multiple) * multiple for n in lengths]
    slots[-1] += pack_size - sum(slots)  # the pack's tail padding goes to its last sequence
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    cu_padded = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_padded[1:] = torch.cumsum(torch.tensor(slots), 0)
    return {"cu_seqlens": cu, "cu_seqlens_padded": cu_padded, "max_seqlen": max(slots)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return min(times)  # best of: the machine may be shared


def time_backend(backend: str, thd: dict, qkv: tuple, repeats: int) -> dict:
    q, k, v = qkv
    device = q.device

    def forward() -> object:
        with torch.no_grad():
            return thd_attention(q, k, v, thd, backend=backend)

    def forward_backward() -> object:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = thd_attention(*leaves, thd, backend=backend)
        out.backward(torch.ones_like(out))
        return out

    row: dict = {"backend": backend}
    try:
        row["forward_s"] = best_seconds(forward, repeats, device)
    except Exception as err:  # one backend's failure is its row's result; the run goes on
        return {**row, **outcome(err)}
    try:
        row["forward_backward_s"] = best_seconds(forward_backward, repeats, device)
    except Exception as err:
        row.update({f"backward_{key}": value for key, value in outcome(err).items()})
    return row


def outcome(err: Exception) -> dict[str, str]:
    """``skipped`` when the selector refuses the backend here (missing package, wrong device or
    dtype), ``failed`` with the exception type for anything else (a kernel error, a bug)."""
    if isinstance(err, (ImportError, ValueError)):
        return {"skipped": str(err)}
    return {"failed": f"{type(err).__name__}: {err}"}


def bf16_errors(thd: dict, qkv32: tuple, attend: Callable, plain: dict | None) -> dict:
    """max |error| of out, dq, dk, dv of ``attend`` on bf16 inputs vs the fp32 reference."""
    valid = _valid(thd, qkv32[0].device)
    ref = _with_grads(qkv32, lambda q, k, v: reference_attention(q, k, v, thd)[0], valid)
    got = _with_grads(tuple(t.bfloat16() for t in qkv32), attend, valid)
    errors = {name: float((got[name].float() - ref[name])[valid].abs().max()) for name in ref}
    if plain is not None:
        errors.update({f"{name}_vs_plain_bf16": errors[name] / max(plain[name], 1e-30) for name in ref})
    return errors


def _valid(thd: dict, device: torch.device) -> torch.Tensor:
    cu, cu_padded = thd["cu_seqlens"].tolist(), thd["cu_seqlens_padded"].tolist()
    valid = torch.zeros(cu_padded[-1], dtype=torch.bool, device=device)
    for i in range(len(cu) - 1):
        valid[cu_padded[i] : cu_padded[i] + cu[i + 1] - cu[i]] = True
    return valid


def _with_grads(qkv: tuple, attend: Callable, valid: torch.Tensor) -> dict:
    leaves = [t.detach().requires_grad_() for t in qkv]
    out = attend(*leaves)
    g = torch.Generator(device=out.device).manual_seed(SEED)
    dout = torch.randn(out.shape, generator=g, device=out.device) * valid[:, None, None]
    out.backward(dout.to(out.dtype))
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def accuracy_rows(thd: dict, qkv32: tuple) -> list[dict]:
    def plain_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return reference_attention(q, k, v, thd)[0]  # plain PyTorch ops, all in bf16

    plain = bf16_errors(thd, qkv32, plain_bf16, None)
    rows = [{"method": "plain torch bf16", **plain}]
    for backend in ("te", "flash", "varlen", "flex", "sdpa"):
        try:
            errors = bf16_errors(thd, qkv32, lambda q, k, v, b=backend: thd_attention(q, k, v, thd, backend=b), plain)
        except Exception as err:  # reported in the row; the other backends still run
            rows.append({"method": backend, **outcome(err)})
            continue
        rows.append({"method": backend, **errors})
    for cp_size in (2, 4):

        def ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int = cp_size) -> torch.Tensor:
            return simulated_ring_attention(q, k, v, thd, cp_size=cp, kernel="flash")[0]

        method = f"ring cp={cp_size} (flash tiles)"
        try:
            rows.append({"method": method, **bf16_errors(thd, qkv32, ring, plain)})
        except Exception as err:
            rows.append({"method": method, **outcome(err)})
    return rows


def print_timing(row: dict) -> None:
    fwd = f"{row['forward_s'] * 1e3:9.2f}" if "forward_s" in row else f"{'-':>9}"
    both = f"{row['forward_backward_s'] * 1e3:11.2f}" if "forward_backward_s" in row else f"{'-':>11}"
    note = next(
        (f"{key}: {row[key]}" for key in ("failed", "skipped", "backward_failed", "backward_skipped") if key in row), ""
    )
    print(f"{row['pack_size']:>6} {row['sequences']:>5} {row['backend']:>8} {fwd} {both}  {note[:70]}")


def print_accuracy(rows: list[dict]) -> None:
    print("\nbf16 max |error| vs fp32 reference (ratio to plain torch bf16 in brackets; target <= 2)")
    for row in rows:
        if "skipped" in row or "failed" in row:
            key = "failed" if "failed" in row else "skipped"
            print(f"{row['pack_size']:>6} {row['method']:>28}  {key}: {row[key][:60]}")
            continue
        cells = []
        for name in ("out", "dq", "dk", "dv"):
            ratio = row.get(f"{name}_vs_plain_bf16")
            cells.append(f"{name} {row[name]:.2e}" + (f" ({ratio:.2f})" if ratio is not None else ""))
        print(f"{row['pack_size']:>6} {row['method']:>28}  {'  '.join(cells)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--pack-sizes", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=None, help="default: math sdpa flex (+ cuda kernels)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--tiny", action="store_true", help="one 256-token pack, 1 repeat (seconds; the tests)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.pack_sizes, args.repeats = [256], 1
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    backends = args.backends or (
        ["math", "sdpa", "flex"] if device.type == "cpu" else ["te", "flash", "varlen", "flex", "sdpa", "math"]
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    results: dict = {
        "device": name,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype),
        "heads": [args.heads, args.kv_heads, args.head_dim],
        "timings": [],
        "accuracy": [],
    }
    print(f"torch {torch.__version__} on {name}, {dtype}, heads {args.heads}/{args.kv_heads} x {args.head_dim}")
    print(f"{'pack':>6} {'seqs':>5} {'backend':>8} {'fwd ms':>9} {'fwd+bwd ms':>11}  note")
    for pack_size in args.pack_sizes:
        batch = make_batch(pack_size, 8, SEED)
        thd = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        g = torch.Generator(device=device).manual_seed(SEED)
        qkv = tuple(
            torch.randn(pack_size, n, args.head_dim, generator=g, device=device, dtype=dtype)
            for n in (args.heads, args.kv_heads, args.kv_heads)
        )
        for backend in backends:
            row = {"pack_size": pack_size, "sequences": len(batch["cu_seqlens"]) - 1}
            row.update(time_backend(backend, thd, qkv, args.repeats))
            results["timings"].append(row)
            print_timing(row)
        if device.type == "cuda":
            qkv32 = tuple(t.float() for t in qkv)
            results["accuracy"] += [{"pack_size": pack_size, **row} for row in accuracy_rows(thd, qkv32)]
    if results["accuracy"]:
        print_accuracy(results["accuracy"])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
