"""``thdpack verify``: prove on this machine that packing + context parallelism is exact.

    thdpack verify --cp-size 2                          # 2 processes, gloo on CPU, fp64
    thdpack verify --cp-size 4 --cp-placement adaptive  # short sequences whole, long ones split over groups
    thdpack verify --cp-size 2 --dp-size 2 --dtype float32 --reduction sequence_mean
    thdpack verify --cp-size 2 --inject-fault local_positions   # watch it catch a RoPE bug

It starts ``dp_size * cp_size`` processes itself (a file:// rendezvous; NCCL when that many GPUs
are visible, else gloo), runs one training step of the reference decoder packed and CP-sharded
and the same step on every sequence alone (``thdpack.verify.exactness``), prints the largest
differences and exits 0 when all are within the dtype's tolerance (float64 1e-10, float32 1e-5,
bfloat16 twice plain bf16's error), 1 when one is not, 2 on an error.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

import torch
import torch.distributed as dist

from thdpack._config_forms import add_options, from_flat
from thdpack.attention.config import BACKENDS, CP_COMM_TYPES, AttentionConfig
from thdpack.cp.topology import CpTopology
from thdpack.loss import LOSS_REDUCTIONS
from thdpack.models.config import MODEL_PRESETS, ModelConfig
from thdpack.models.transformer import Transformer
from thdpack.plan.config import TRAINING_CP_PLACEMENT, PlanConfig
from thdpack.testing import run_distributed
from thdpack.thd.batch import thd_to_device
from thdpack.thd.carriage import thd_meta
from thdpack.verify.exactness import (
    FAULTS,
    StepSpread,
    baseline_errors,
    differences,
    global_micro_batches,
    magnitudes,
    make_samples,
    pack_size_for,
    packed_step,
    sample_lengths,
    unpacked_step,
)

VerifyDtype = Literal["float64", "float32", "bfloat16"]
VERIFY_DTYPES: tuple[VerifyDtype, ...] = get_args(VerifyDtype)
DeviceChoice = Literal["auto", "cpu", "cuda"]
DEVICE_CHOICES: tuple[DeviceChoice, ...] = get_args(DeviceChoice)
TOLERANCE = {"float64": 1e-10, "float32": 1e-5}
"""Max abs difference allowed per quantity; bfloat16 is judged against plain bf16 instead."""
BF16_FACTOR = 2.0
"""bfloat16 passes when its error against fp32 is at most this times the plain bf16 step's."""
BF16_FLOOR = 1e-6
"""...plus this, so that quantities that plain bf16 gets exactly right may carry rounding noise."""


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``thdpack verify`` options."""
    parser.add_argument("--cp-size", type=int, required=True, help="context-parallel ranks (processes per DP rank)")
    parser.add_argument("--dp-size", type=int, default=1, help="data-parallel ranks (default 1)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="attention backend (default auto)")
    parser.add_argument("--dtype", choices=VERIFY_DTYPES, default="float64", help="precision (default float64)")
    parser.add_argument("--cp-comm-type", choices=CP_COMM_TYPES, default="p2p", help="CP K/V exchange")
    add_options(parser, PlanConfig, only=("cp_placement",), defaults={"cp_placement": TRAINING_CP_PLACEMENT})
    parser.add_argument("--reduction", choices=LOSS_REDUCTIONS, default="token_mean", help="loss normalisation")
    parser.add_argument("--micro-steps", type=int, default=2, help="gradient-accumulation micro-steps (default 2)")
    parser.add_argument("--model", choices=MODEL_PRESETS, default="tiny", help="model preset (default tiny)")
    parser.add_argument(
        "--device", choices=DEVICE_CHOICES, default="auto", help="auto: one GPU per rank if enough, else CPU"
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and data seed")
    parser.add_argument(
        "--inject-fault",
        choices=FAULTS,
        default="none",
        help="plant a known layout bug (the check must then fail)",
    )


@dataclass(frozen=True, kw_only=True)
class VerifyJob:
    """Everything a rank needs (picklable: it crosses the spawn)."""

    spread: StepSpread
    config: ModelConfig
    dtype: VerifyDtype
    device_type: Literal["cpu", "cuda"]
    seed: int


def run_verify(args: argparse.Namespace) -> int:
    """Run the check described by ``args`` and print the table of differences.

    Args:
        args: the parsed options of ``thdpack verify`` (``add_verify_arguments``).

    Returns:
        0 (exact), 1 (a difference over tolerance) or 2 (a rank failed).
    """
    job = _job(args)
    world = job.spread.world_size
    try:
        results = run_distributed(
            _rank_check,
            world,
            job,
            backend="nccl" if job.device_type == "cuda" else "gloo",
            threads=max(1, (os.cpu_count() or 1) // world),
        )
    except RuntimeError as err:  # a rank failed: its first line names the rank and the error
        where, _, trace = str(err).partition("\n")
        print(f"thdpack verify: error on {where}", file=sys.stderr)
        print(trace, file=sys.stderr)
        return 2
    report = results[0]
    print(_header(job, report))
    rows = _rows(job, report)
    print(_table(rows))
    failed = [row.quantity for row in rows if not row.ok]
    worst = max(rows, key=lambda row: row.diff / row.tolerance)
    if failed:
        print(
            f"FAIL: {len(failed)} of {len(rows)} quantities differ beyond tolerance (first: {failed[0]}); the packed "
            "step is NOT the unpacked one"
        )
        return 1
    print(
        f"PASS: the packed step equals the unpacked one (worst: {worst.quantity}, {worst.diff:.2e} <= "
        f"{worst.tolerance:.1e})"
    )
    return 0


def _job(args: argparse.Namespace) -> VerifyJob:
    # each field from the option of its name; --inject-fault says what the fault field is for
    spread = from_flat(StepSpread, {**vars(args), "fault": args.inject_fault})
    config = ModelConfig.preset(
        args.model, attention=AttentionConfig(backend=args.backend, cp_comm_type=args.cp_comm_type)
    )
    world = spread.world_size
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cuda" and gpus < world:
        raise ValueError(
            f"--device cuda needs one GPU per rank: {world} ranks (dp {spread.dp_size} x cp {spread.cp_size}), "
            f"{gpus} GPUs visible; use --device cpu or fewer ranks"
        )
    device_type: Literal["cpu", "cuda"] = (
        "cuda" if args.device == "cuda" or (args.device == "auto" and gpus >= world) else "cpu"
    )
    return VerifyJob(spread=spread, config=config, dtype=args.dtype, device_type=device_type, seed=args.seed)


def _rank_check(rank: int, world: int, job: VerifyJob) -> dict[str, Any]:
    """This rank's packed step against the unpacked one; the max differences over all ranks."""
    spread, config = job.spread, job.config
    device = torch.device(job.device_type, rank if job.device_type == "cuda" else 0)
    backend_log = _capture_backend_choice()
    topology = CpTopology.create(
        spread.cp_size, device_type=job.device_type, placement_groups=spread.cp_placement != "te"
    )
    lengths = sample_lengths(spread)
    samples = make_samples(lengths, config.vocab_size, job.seed)
    pack_size = pack_size_for(lengths, spread.cp_size, spread.cp_placement)
    batches = global_micro_batches(samples, spread, pack_size)
    micro_batches = [thd_to_device(thd, device) for thd in batches[topology.dp_rank]]
    half = job.dtype == "bfloat16"
    param_dtype = torch.float32 if half else getattr(torch, job.dtype)
    autocast = torch.bfloat16 if half else None

    def model() -> Transformer:
        return Transformer(config, seed=job.seed, device=device, dtype=param_dtype)

    packed = packed_step(model(), micro_batches, spread, topology, autocast_dtype=autocast)
    reference = unpacked_step(model(), samples, spread.reduction)
    diffs = differences(packed, reference)
    names = list(diffs)
    worst = _all_max(torch.tensor([diffs[n] for n in names], dtype=torch.float64, device=device))
    report: dict[str, Any] = {"diffs": dict(zip(names, worst.tolist(), strict=True)), "sizes": magnitudes(reference)}
    if half:  # plain bf16: the same unpacked step under autocast, against the same fp32 reference
        plain = unpacked_step(model(), samples, spread.reduction, autocast_dtype=autocast)
        report["plain_bf16"] = baseline_errors(plain, reference)
    report.update(
        sequences=len(samples),
        tokens=sum(lengths),
        pack_size=pack_size,
        packs=sum(int(thd["input_ids"].shape[0]) // pack_size for per_rank in batches for thd in per_rank),
        backend=backend_log.messages[0] if backend_log.messages else "no attention call logged",
        device=str(device.type),
        placement=_placement_counts(batches, spread.cp_size),
    )
    return report


def _placement_counts(batches: list[list[Any]], cp_size: int) -> str:
    """How the step's sequences sit on the CP ranks: ``"5 whole, 3 split over 2, 2 over 4"``."""
    if cp_size == 1:
        return "no CP"
    counts: dict[int, int] = {}
    for per_rank in batches:
        for thd in per_rank:
            meta = thd_meta(thd)
            sizes = meta.groups.size_S if meta.groups is not None else [cp_size] * meta.num_sequences
            for n, g in zip(meta.lengths, sizes, strict=True):
                if n > 0:  # padding entries hold no sequence
                    counts[int(g)] = counts.get(int(g), 0) + 1
    whole = counts.pop(1, 0)
    return ", ".join([f"{whole} whole on one rank"] + [f"{n} split over {g}" for g, n in sorted(counts.items())])


def _all_max(values: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.cpu()


class _BackendLog(logging.Handler):
    """Keeps the ``thdpack.attention`` backend-choice lines of this process."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _capture_backend_choice() -> _BackendLog:
    handler = _BackendLog()
    log = logging.getLogger("thdpack.attention")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return handler


def _header(job: VerifyJob, report: dict[str, Any]) -> str:
    spread = job.spread
    transport = "NCCL" if job.device_type == "cuda" else "gloo"
    fault = f", injected fault: {spread.fault}" if spread.fault != "none" else ""
    return "\n".join(
        [
            f"thdpack verify: dp {spread.dp_size} x cp {spread.cp_size} = {spread.world_size} processes "
            f"({transport}, {report['device']}), {job.dtype}, {spread.micro_steps} micro-steps, "
            f"{spread.reduction}, cp_placement {spread.cp_placement}{fault}",
            f"  data: {report['sequences']} sequences, {report['tokens']} tokens, {report['packs']} packs of "
            f"{report['pack_size']}; model: {job.config.n_layers} layers, dim {job.config.dim}, "
            f"{job.config.n_heads}/{job.config.n_kv_heads} heads",
            f"  sequences on the CP ranks: {report['placement']}",
            f"  attention: {report['backend']}",
        ]
    )


class Row(NamedTuple):
    """One line of the table."""

    quantity: str
    size: float
    """Max abs value in the unpacked step."""
    diff: float
    """Max abs difference, packed vs unpacked, over all ranks."""
    tolerance: float
    ok: bool


def _rows(job: VerifyJob, report: dict[str, Any]) -> list[Row]:
    rows = []
    for name, diff in report["diffs"].items():
        if job.dtype == "bfloat16":
            tolerance = BF16_FACTOR * report["plain_bf16"][name] + BF16_FLOOR
        else:
            tolerance = TOLERANCE[job.dtype]
        rows.append(Row(name, report["sizes"][name], diff, tolerance, diff <= tolerance))
    return rows


def _table(rows: Sequence[Row]) -> str:
    width = max(len("quantity"), *(len(r.quantity) for r in rows))
    header = f"{'quantity':<{width}}  {'max |unpacked|':>14}  {'max |packed - unpacked|':>23}  {'tolerance':>9}  result"
    lines = [header]
    for r in rows:
        lines.append(
            f"{r.quantity:<{width}}  {r.size:>14.3e}  {r.diff:>23.3e}  {r.tolerance:>9.1e}  {'ok' if r.ok else 'FAIL'}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m thdpack.verify ...`` (the same as ``thdpack verify ...``)."""
    parser = argparse.ArgumentParser(prog="thdpack verify", description=__doc__.splitlines()[0])
    add_verify_arguments(parser)
    return run_verify(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
