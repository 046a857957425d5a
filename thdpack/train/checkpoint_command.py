"""``thdpack checkpoint info DIR``: what a checkpoint's data stream consumed and what remains.

    thdpack checkpoint info outputs/train                   # its newest checkpoint (checkpoints/latest)
    thdpack checkpoint info outputs/train/checkpoints/step_000040
    thdpack checkpoint info out/checkpoint-500              # a Trainer integration's checkpoint
    thdpack checkpoint info DIR --pieces                    # every consumed sequence (or piece) too

It reads the stream record (JSON and arrays, nothing unpickled) and prints the epoch, the position
in its plan and the plan's settings, the sequences and tokens consumed and remaining, and the
digest of the consumed pieces, recomputed from the arrays (``thdpack.packing.pieces``). A thdpack
checkpoint's files are verified first. Exit codes: 0, 1 when the checkpoint is damaged, 2 when DIR
holds no checkpoint.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from thdpack.files.state_file import read_state
from thdpack.packing.pieces import arrays_digest

TRAINER_STREAM = "stream.json"
INTEGRATION_STREAM = "thdpack_stream.json"


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``thdpack checkpoint`` options."""
    parser.add_argument("action", choices=["info"], help="info: what the checkpoint's data stream consumed")
    parser.add_argument(
        "dir", type=Path, help="a checkpoint folder, a checkpoints/ folder or an output_dir (its newest checkpoint)"
    )
    parser.add_argument("--pieces", action="store_true", help="list every consumed sequence (or piece of one)")
    parser.add_argument("--json", action="store_true", help="print the record as JSON (without its arrays)")


def find_checkpoint(folder: Path) -> Path:
    """The checkpoint ``folder`` names: itself, or the newest one below it (``checkpoints/latest``,
    the highest ``checkpoint-N``); ``ValueError`` when there is none."""
    for candidate in (folder, folder / "checkpoints"):
        if (candidate / TRAINER_STREAM).is_file() or (candidate / INTEGRATION_STREAM).is_file():
            return candidate
        latest = candidate / "latest"
        if latest.is_file() and (candidate / latest.read_text().strip()).is_dir():
            return candidate / latest.read_text().strip()
    numbered = [p for p in folder.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()]
    if numbered:
        return max(numbered, key=lambda p: int(p.name.split("-")[-1]))
    raise ValueError(
        f"{folder} holds no checkpoint with a data stream record ({TRAINER_STREAM} or {INTEGRATION_STREAM}): name "
        "a checkpoint folder, a checkpoints/ folder or a train.output_dir"
    )


def stream_record(checkpoint: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the stream's state, what holds it: step and data) of ``checkpoint``, arrays included."""
    if (checkpoint / TRAINER_STREAM).is_file():
        manifest = checkpoint / "checksums.json"
        step = json.loads(manifest.read_text()).get("step") if manifest.is_file() else None
        return read_state(checkpoint / TRAINER_STREAM), {"step": step}
    saved = read_state(checkpoint / INTEGRATION_STREAM)
    state = {**saved["stream"], "arrays": saved.get("arrays", {})}
    return state, {"step": saved.get("steps_done"), "data": saved.get("data")}


def _consumed_pieces(arrays: dict[str, np.ndarray]) -> list[str]:
    """One line per consumed sequence: ``17`` whole, ``18 [0, 128)`` a piece."""
    whole = np.flatnonzero(np.unpackbits(arrays["consumed.whole"]))
    lines = {int(s): str(int(s)) for s in whole}
    for s, a, n in zip(arrays["consumed.sample"], arrays["consumed.start"], arrays["consumed.length"], strict=True):
        lines[int(s)] = f"{lines.get(int(s), int(s))} [{int(a)}, {int(a + n)})"
    return [lines[s] for s in sorted(lines)]


def describe(checkpoint: Path, state: dict[str, Any], holder: dict[str, Any]) -> list[str]:
    """The lines ``thdpack checkpoint info`` prints of ``state``."""
    if state.get("format") != "thdpack-step-stream":
        return [
            f"{checkpoint}: epoch {state['epoch']}, pack {state['position']} of its plan; written by an older thdpack "
            "that did not record the consumed sequences"
        ]
    settings, layout, consumed, remaining = state["settings"], state["layout"], state["consumed"], state["remaining"]
    arrays = state["arrays"]
    digest = arrays_digest({key: arrays[f"consumed.{key}"] for key in ("whole", "sample", "start", "length")})
    plan = ", ".join(f"{k}={v}" for k, v in settings.items() if k not in ("packs_per_step", "num_sequences"))
    layout_line = " x ".join(f"{k} {v}" for k, v in layout.items())
    replans = state["replans"]
    replanned = f"; the rest of the epoch planned again {replans} time{'s' * (replans != 1)}" if replans else ""
    packs = "not begun" if state["plan_packs"] is None else f"{state['position']:,} of {state['plan_packs']:,} packs"
    total_tokens = consumed["tokens"] + remaining["tokens"]
    lines = [
        f"checkpoint {checkpoint}" + (f" (step {holder['step']})" if holder.get("step") is not None else ""),
        f"data: {settings['num_sequences']:,} sequences, {total_tokens:,} tokens"
        + (f"; examples' sha256 {holder['data']['sha256']}" if holder.get("data") else ""),
        f"layout: {layout_line} = {settings['packs_per_step']} packs per step",
        f"plan: {plan}",
        f"epoch {state['epoch']}: {packs} of its plan{replanned}",
        f"consumed: {consumed['sequences_whole']:,} sequences whole, {consumed['sequences_in_part']:,} in part, "
        f"{consumed['tokens']:,} tokens",
        f"remaining: {remaining['sequences']:,} sequences (whole or in part), {remaining['tokens']:,} tokens",
        f"consumed sha256: {digest} (recomputed from the arrays: "
        f"{'matches the record' if digest == consumed['sha256'] else 'DOES NOT MATCH ' + consumed['sha256']})",
    ]
    return lines


def run_checkpoint(args: argparse.Namespace) -> int:
    checkpoint = find_checkpoint(args.dir)
    problems: list[str] = []
    if (checkpoint / "checksums.json").is_file():
        from thdpack.train.checkpoint import verify_checkpoint

        problems = verify_checkpoint(checkpoint)
    if problems:
        print("\n".join(f"damaged: {problem}" for problem in problems))
        return 1
    state, holder = stream_record(checkpoint)
    if args.json:
        print(json.dumps({**{k: v for k, v in state.items() if k != "arrays"}, **holder}, indent=1, sort_keys=True))
    else:
        print("\n".join(describe(checkpoint, state, holder)))
        if (checkpoint / "checksums.json").is_file():
            print("files: every file matches checksums.json")
    if args.pieces and "arrays" in state and "consumed.whole" in state["arrays"]:
        print("\n".join(_consumed_pieces(state["arrays"])))
    return 0
