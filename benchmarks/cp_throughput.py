"""End-to-end context-parallel training steps: TE's layout vs a per-sequence placement vs all-to-all.

    python benchmarks/train_throughput.py --cp 2                  # the same as below
    python benchmarks/cp_throughput.py --cp 2 --out DIR           # 2 CPU processes (gloo), cp 2, a few minutes
    python benchmarks/cp_throughput.py --lengths my.lengths.npy   # any 1-D .npy of document lengths
    python benchmarks/cp_throughput.py --tiny --out DIR           # seconds (the tests run this)

``cp`` processes (one CP group, dp 1, gloo on the CPU; NCCL on as many GPUs with ``--device
cuda``) train thdpack's decoder on the SAME packs in three modes, each with its own copy of the
same initial weights and its own AdamW:

- ``te``: Transformer Engine's layout: every sequence split over all ``cp`` ranks in ``2*cp``
  chunks, attention by thdpack's ring (``cp_comm_type="p2p"``).
- ``adaptive``: the same packs under the per-sequence placement
  (``thdpack.plan.adaptive.place_packs``, the placement ``plan_packs(...,
  cp_placement="adaptive")`` gives its packs): short sequences whole on one rank through the
  local kernel, long ones split, through the ring over their group only.
- ``a2a``: TE's layout with ``cp_comm_type="a2a"``: two all-to-alls per layer, each rank attends
  whole sequences for ``heads / cp`` heads.

The packs are those of one bfd plan of the lengths (documents longer than a pack split into
pieces, counted), ``step_tokens / L`` random packs per step, the same in every mode. A step is
one optimizer step as the trainer runs it (``prepare_micro_batches``: collate, CP shard;
``forward_backward`` under DDP over the CP group; AdamW). The modes take turns step by step
(rotating the order), so a shared machine's slow spells hit them alike; a step's time is the
slowest rank's (the ranks meet in a barrier before it), and the table gives each mode's median
over ``--steps`` timed steps after ``--warmup``, its real tokens/s, and its ratio to ``te`` (the
issue's target: ``adaptive`` faster than ``te`` on Alpaca at cp 2). The losses of the first step
agree between the modes (they are the same computation), which the run checks.

Writes ``cp_throughput.json`` and ``cp_throughput.md`` into ``--out``. Every number is measured
on the device named next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

from throughput_inputs import CPU_MODEL, DATASETS, SEED, TINY_MODEL, load_lengths, split_documents  # noqa: E402

from thdpack.cp.topology import CpTopology  # noqa: E402
from thdpack.layout.placement import PackPlacement  # noqa: E402
from thdpack.layout.rules import cp_multiple  # noqa: E402
from thdpack.models import ModelConfig, Transformer  # noqa: E402
from thdpack.packing.packer import pack_from_segments  # noqa: E402
from thdpack.plan import plan_packs  # noqa: E402
from thdpack.plan.adaptive import place_packs  # noqa: E402
from thdpack.testing import run_distributed  # noqa: E402
from thdpack.thd import thd_collate  # noqa: E402
from thdpack.train.forward_backward import forward_backward, prepare_micro_batches  # noqa: E402

CpMode = Literal["te", "adaptive", "a2a"]
CP_MODES: tuple[CpMode, ...] = get_args(CpMode)
COMM_TYPE: dict[CpMode, str] = {"te": "p2p", "adaptive": "p2p", "a2a": "a2a"}


@dataclass(frozen=True, kw_only=True)
class CpThroughputConfig:
    """One run: the model, the pack size, the step and the timing protocol."""

    model: ModelConfig = CPU_MODEL
    """The decoder (attention ``auto``: the math ring on the CPU)."""
    cp_size: int = 2
    pack_size: int = 4096
    """L: tokens of a pack (``L / cp`` on each rank)."""
    packs_per_step: int = 4
    """Packs of an optimizer step, one per micro-batch."""
    warmup: int = 1
    steps: int = 5
    seed: int = SEED

    def __post_init__(self) -> None:
        for name in ("cp_size", "pack_size", "packs_per_step", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.cp_size < 2:
            raise ValueError(f"cp_size must be >= 2 to compare CP layouts, got {self.cp_size}")
        unit = cp_multiple(self.cp_size)
        if self.pack_size % unit:
            raise ValueError(
                f"pack_size={self.pack_size} is not a multiple of 2*cp_size={unit}; TE's layout cuts "
                f"every sequence into 2*cp chunks: use pack_size={-(-self.pack_size // unit) * unit}"
            )
        if self.model.n_heads % self.cp_size:
            raise ValueError(
                f"the all-to-all gives each of the {self.cp_size} ranks n_heads / cp heads; "
                f"n_heads={self.model.n_heads} is not a multiple of cp_size"
            )


TINY = CpThroughputConfig(model=TINY_MODEL, pack_size=256, packs_per_step=2, warmup=1, steps=2)
"""``--tiny``: seconds."""


@dataclass(frozen=True)
class StepPlan:
    """The packs of ``count`` steps of ``packs_per_step`` packs: pack ``k`` is ``segments[k]`` of one
    bfd plan (TE slots), its entries ``lengths_E[offsets[k]:offsets[k + 1]]`` placed on groups
    ``size_E`` / ``start_E`` for the adaptive mode."""

    segments: list[Any]
    lengths_E: np.ndarray
    offsets: np.ndarray
    size_E: np.ndarray
    start_E: np.ndarray


def step_plan(
    pieces_S: np.ndarray, cfg: CpThroughputConfig, count: int, rng: np.random.Generator | None = None
) -> StepPlan:
    """The packs every mode trains on, drawn with ``rng`` (default: seeded by ``cfg.seed``) from ONE
    bfd plan of ``pieces_S``, the adaptive mode's placement by ``place_packs`` (what
    ``benchmarks/cp_model_check.py`` models)."""
    rng = np.random.default_rng(cfg.seed) if rng is None else rng
    cp = cfg.cp_size
    plan = plan_packs(pieces_S, cfg.pack_size, cp_size=cp, algorithm="bfd")
    need = count * cfg.packs_per_step
    if len(plan) < cfg.packs_per_step:
        raise ValueError(
            f"the lengths fill {len(plan)} packs of {cfg.pack_size} tokens, fewer than the {cfg.packs_per_step} of "
            "one step; use fewer packs_per_step or a larger lengths file"
        )
    order = np.concatenate([rng.permutation(len(plan)) for _ in range(-(-need // len(plan)))])[:need]
    segments = [plan.segments(int(i)) for i in order]
    lengths_E = np.concatenate([lengths for _, _, lengths in segments])
    offsets = np.concatenate([[0], np.cumsum([len(lengths) for _, _, lengths in segments])])
    size_E, start_E = place_packs(
        lengths_E, np.arange(len(lengths_E)), offsets, cp_size=cp, pack_size=cfg.pack_size, cost_model="tiles"
    )
    return StepPlan(segments, lengths_E, offsets, size_E, start_E)


def step_packs(pieces_S: np.ndarray, cfg: CpThroughputConfig, count: int) -> list[list[dict[str, Any]]]:
    """``count`` steps of ``cfg.packs_per_step`` packs each, per mode: ``[{mode: pack}, ...]`` per
    step, the packs of ``step_plan``. Random token ids; every real token bears loss."""
    rng = np.random.default_rng(cfg.seed)
    planned = step_plan(pieces_S, cfg, count, rng)  # the token ids continue its stream
    cp = cfg.cp_size
    samples = [
        {"input_ids": rng.integers(1, cfg.model.vocab_size, n), "labels": rng.integers(1, cfg.model.vocab_size, n)}
        for n in pieces_S.tolist()
    ]
    steps: list[list[dict[str, Any]]] = []
    for k, segment in enumerate(planned.segments):
        a, b = int(planned.offsets[k]), int(planned.offsets[k + 1])
        placement = PackPlacement(cp, cfg.pack_size, planned.lengths_E[a:b], planned.size_E[a:b],
                                  planned.start_E[a:b])  # fmt: skip
        te = pack_from_segments(samples, segment, cfg.pack_size, cp_size=cp)
        adaptive = pack_from_segments(samples, segment, cfg.pack_size, cp_size=cp, placement=placement)
        if k % cfg.packs_per_step == 0:
            steps.append([])
        steps[-1].append({"te": te, "adaptive": adaptive, "a2a": te})
    return steps


def rank_main(rank: int, world: int, cfg: CpThroughputConfig, steps: list[list[dict[str, Any]]]) -> dict:
    """One CP rank: train every mode's copy of the model on the steps, interleaved; per mode the
    slowest rank's step seconds and the losses."""
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    topology = CpTopology.create(world, device_type=device.type)  # the adaptive packs' pairs and quads too
    models, optimizers = {}, {}
    for mode in CP_MODES:
        config = replace(cfg.model, attention=replace(cfg.model.attention, cp_comm_type=COMM_TYPE[mode]))
        model = Transformer(config, seed=cfg.seed).to(device)
        models[mode] = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[rank] if device.type == "cuda" else None
        )
        optimizers[mode] = torch.optim.AdamW(models[mode].parameters(), lr=3e-4)
    seconds: dict[str, list[float]] = {m: [] for m in CP_MODES}
    losses: dict[str, list[float]] = {m: [] for m in CP_MODES}
    for i, step in enumerate(steps):
        modes = CP_MODES[i % len(CP_MODES) :] + CP_MODES[: i % len(CP_MODES)]
        for mode in modes:
            micro = [thd_collate([packs[mode]]) for packs in step]
            dist.barrier()
            start = time.perf_counter()
            local = prepare_micro_batches(micro, topology=topology, device=device, reduction="token_mean")
            step_loss = forward_backward(models[mode], local, topology=topology)
            optimizers[mode].step()
            optimizers[mode].zero_grad(set_to_none=True)
            loss = float(step_loss.value())
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= cfg.warmup:
                seconds[mode].append(float(elapsed))
            losses[mode].append(loss)
    return {"seconds": seconds, "losses": losses}


def run(cfg: CpThroughputConfig, lengths_S: np.ndarray, data: str, device: str = "cpu") -> dict[str, Any]:
    """Measure the three modes on ``lengths_S``; the result dict (rows, config, device)."""
    pieces_S, split = split_documents(lengths_S, cfg.pack_size)
    steps = step_packs(pieces_S, cfg, cfg.warmup + cfg.steps)
    backend = "nccl" if device == "cuda" else "gloo"
    per_rank = run_distributed(rank_main, cfg.cp_size, cfg, steps, backend=backend, timeout=3600.0)
    measured = per_rank[0]
    first = {m: measured["losses"][m][0] for m in CP_MODES}
    spread = max(first.values()) - min(first.values())
    if spread > 1e-3 * max(abs(v) for v in first.values()):
        raise AssertionError(f"the modes' first-step losses differ ({first}); they train the same packs")
    real = sum(int(packs["te"]["seq_lens"].sum()) for step in steps[cfg.warmup :] for packs in step)
    real_per_step = real / cfg.steps
    rows = []
    te_median = statistics.median(measured["seconds"]["te"])
    for mode in CP_MODES:
        times = measured["seconds"][mode]
        median = statistics.median(times)
        rows.append(
            {
                "data": data, "pack_size": cfg.pack_size, "cp_size": cfg.cp_size, "mode": mode,
                "cp_comm_type": COMM_TYPE[mode], "step_s_median": median, "step_s": times,
                "real_tokens_per_s": real_per_step / median, "vs_te": te_median / median,
                "first_loss": first[mode],
            }
        )  # fmt: skip
    return {
        "rows": rows,
        "config": {**asdict(cfg), "model": asdict(cfg.model)},
        "documents": len(lengths_S),
        "documents_split": split,
        "real_tokens_per_step": real_per_step,
        "device": _device_name(device),
        "torch": torch.__version__,
    }


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), 1 thread per rank"


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| data | L | cp | mode | step (median, s) | real tokens/s | te time / mode time | device |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for row in result["rows"]:
            lines.append(
                f"| {row['data']} | {row['pack_size']} | {row['cp_size']} | {row['mode']} ({row['cp_comm_type']}) | "
                f"{row['step_s_median']:.3f} | {row['real_tokens_per_s']:,.0f} | {row['vs_te']:.2f}x | "
                f"{result['device']} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny model, L 256, seconds")
    parser.add_argument("--cp", type=int, default=2, help="CP size = processes (default 2)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--lengths", type=Path, nargs="+", default=None, help="lengths files (default: alpaca, stdlib)")
    parser.add_argument("--pack-size", type=int, default=None)
    parser.add_argument("--packs-per-step", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    cfg = replace(TINY if args.tiny else CpThroughputConfig(), cp_size=args.cp)
    overrides = {
        "pack_size": args.pack_size, "packs_per_step": args.packs_per_step, "warmup": args.warmup, "steps": args.steps,
    }  # fmt: skip
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    paths = args.lengths or [path for path in DATASETS.values() if path.exists()]
    if args.tiny and args.lengths is None:
        paths = [DATASETS["stdlib"]]
    results = []
    for path in paths:
        lengths_S, empty = load_lengths(path)
        data = path.name.split(".")[0]
        result = run(cfg, lengths_S, data, args.device)
        result["empty_documents"] = empty
        results.append(result)
        print(markdown([result]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cp_throughput.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "cp_throughput.md").write_text(markdown(results))
    print(f"wrote {args.out / 'cp_throughput.json'} and {args.out / 'cp_throughput.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
