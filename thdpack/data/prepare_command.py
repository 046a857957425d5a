"""``thdpack prepare``: read, tokenize, store tokens, plan packs, report. One pass, bounded memory.

    thdpack prepare stdlib --tokenizer gpt2 --pack-size 4096 --out runs/stdlib   # embedded corpus
    thdpack prepare data/*.jsonl --pack-size 8192 --cp-size 2 --out runs/web
    thdpack prepare alpaca_data.json --pack-size 2048 --algorithm bfd --out runs/alpaca
    thdpack prepare sharegpt.jsonl --tokenizer models/qwen --pack-size 4096 --on-bad-record skip --out runs/chat

The folder holds the token store, ``plan.npz`` (epoch 0's plan exactly as the trainer makes it,
its settings and checksum in ``manifest.json["plan"]``, so a run with the same settings trains on
it) and plots. Bad records stop the run naming the file and line, or with ``--on-bad-record
skip`` are counted and listed in ``skipped_records.jsonl``. The run holds the folder's lock from
its first file to its last.
"""

from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path
from typing import Any

import numpy as np

from thdpack._config_forms import add_options, from_flat
from thdpack._optional import has_module
from thdpack.data.bad_records import ON_BAD_RECORD
from thdpack.data.encode import CHAT_TEMPLATE_CHOICES, SAMPLE_FORMATS, TokenizeConfig
from thdpack.data.prepared_plan import PLAN_FILE, write_prepared_plan
from thdpack.data.records import RECORD_KINDS
from thdpack.data.sources import SOURCE_FORMATS, SourceConfig
from thdpack.data.store import TokenStore
from thdpack.data.write_store import SKIPPED_FILE, NoSamplesError, write_token_store
from thdpack.files.lock import FolderLock, lock_file_of
from thdpack.files.publish import disk_full_note
from thdpack.layout.rules import check_pack_size
from thdpack.packing.dataset import DATASET_SEED
from thdpack.perf.time_cost import timing_of
from thdpack.plan.config import TRAINING_CP_PLACEMENT, PlanConfig


def add_prepare_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``thdpack prepare`` arguments."""
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="jsonl / json / parquet file, HF save_to_disk folder, text folder, or 'stdlib' "
        "(several are read one after another)",
    )
    parser.add_argument(
        "--tokenizer",
        default="gpt2",
        help="'gpt2' (shipped), a tokenizer.json, or a Hugging Face tokenizer folder (tokenizer.json + "
        "tokenizer_config.json; its chat template renders chat records) (default: gpt2)",
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    # the plan's settings: one option per field of thdpack.plan.PlanConfig, with its help and check;
    # the trainer's defaults (its packing.seed and cp_placement), so that plan.npz is the trainer's epoch 0
    add_options(
        parser,
        PlanConfig,
        defaults={"seed": DATASET_SEED, "cp_placement": TRAINING_CP_PLACEMENT},
        notes={"seed": "The base seed, as the trainer's packing.seed."},
    )
    parser.add_argument("--cp-size", type=int, default=1, help="context-parallel size (default: 1)")
    parser.add_argument("--format", default="auto", choices=["auto", *SOURCE_FORMATS], help="input format")
    parser.add_argument("--split", help="split of an HF DatasetDict folder")
    parser.add_argument(
        "--decode-errors",
        choices=["strict", "replace"],
        help="non-UTF-8 bytes (default: strict; stdlib: replace)",
    )
    parser.add_argument("--kind", default="auto", choices=["auto", *RECORD_KINDS], help="record kind")
    parser.add_argument("--text-key", default="text", help="field holding a document's text (default: text)")
    parser.add_argument("--no-eos", action="store_true", help="do not append EOS to documents and responses")
    parser.add_argument("--eos-id", type=int, help="EOS token id (default: the tokenizer's)")
    parser.add_argument("--train-on-prompt", action="store_true", help="SFT: prompt tokens are targets too")
    parser.add_argument(
        "--chat-template",
        default="auto",
        choices=CHAT_TEMPLATE_CHOICES,
        help="chat records: the tokenizer's own chat template when it has one (auto), always it (tokenizer), "
        "or the plain '### User:' template (plain) (default: auto)",
    )
    parser.add_argument(
        "--on-bad-record",
        default="fail",
        choices=ON_BAD_RECORD,
        help="a record that cannot be a sample (empty chat, no assistant turn, unknown role, bad JSON): stop "
        f"naming its file and line (fail), or skip it, counted per reason and listed in {SKIPPED_FILE} "
        "(skip) (default: fail)",
    )
    parser.add_argument(
        "--sample-format",
        default="labels",
        choices=SAMPLE_FORMATS,
        help="how samples are read (default: labels)",
    )
    parser.add_argument("--batch-size", type=int, default=512, help="records per tokenizer call (default: 512)")
    parser.add_argument("--limit", type=int, help="read only the first N records (a quick trial)")
    parser.add_argument("--overwrite", action="store_true", help="replace a token store already in --out")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: on a TTY)",
    )


def run_prepare(args: argparse.Namespace) -> int:
    """Run ``thdpack prepare``; 0 on success, 2 with a message on stderr for bad input."""
    try:
        return _prepare(args)
    except OSError as err:
        print(f"thdpack prepare: error: {_write_failure(args.out, err)}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, ImportError) as err:
        print(f"thdpack prepare: error: {err}", file=sys.stderr)
        return 2


def _write_failure(out: Path, err: OSError) -> str:
    """``err`` with the folder named when the error names no file (a write to a full disk says only
    "[Errno 28] No space left on device"), and what to do when ``out`` cannot be written at all (a
    read-only mount said only "[Errno 30] Read-only file system: '.../.store.lock'")."""
    full = disk_full_note(out, err, by_free_space=False)
    if full is not None:
        return f"{full} ({err}); free space there or choose another --out, then run again"
    if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return (
            f"--out {out} cannot be written ({err.strerror}: {err.filename or out}): prepare writes the store into "
            f"that folder and its lock file, {lock_file_of(out).name}, beside it; choose an --out on a file system "
            "this process can write"
        )
    return str(err) if err.filename is not None else f"{err} (writing {out})"


def plan_config_of(args: argparse.Namespace) -> PlanConfig:
    """The ``PlanConfig`` of the command line: each of its fields from the option of that name."""
    return from_flat(PlanConfig, vars(args))


def _prepare(args: argparse.Namespace) -> int:
    # check the planning arguments now, not after an hour of tokenizing
    config = plan_config_of(args)
    check_pack_size(config.pack_size, args.cp_size)
    out: Path = args.out
    with FolderLock(out) as lock:
        return _prepare_locked(args, config, out, lock)


def _prepare_locked(args: argparse.Namespace, config: PlanConfig, out: Path, lock: FolderLock) -> int:
    try:
        store = _write_store(args, out, lock)
    except NoSamplesError as err:
        raise ValueError(f"{err.summary}; check the inputs and --kind / --text-key") from None
    lengths = store.lengths
    print(
        f"sample lengths ({store.sample_format}): min {lengths.min():,}, median {int(np.median(lengths)):,}, "
        f"max {lengths.max():,}; over pack_size={args.pack_size:,}: {int((lengths > args.pack_size).sum()):,}"
    )
    try:
        plan = write_prepared_plan(out, store.lengths, config, cp_size=args.cp_size, timing=timing_of(config))
    except ValueError as err:
        raise ValueError(f"{err}\n(the token store in {out} is complete; only planning failed)") from err
    print(f"\n{plan.stats}\n")
    _write_plots(store, plan, args.no_plots, out)
    files = ["tokens.bin", "offsets.npy", *(["loss_mask.bin"] if store.manifest["has_loss_mask"] else [])]
    files += [SKIPPED_FILE] if (out / SKIPPED_FILE).exists() else []
    print(f"wrote {out}/: {', '.join(files)}, {PLAN_FILE}, manifest.json")
    return 0


def _write_store(args: argparse.Namespace, out: Path, lock: FolderLock) -> TokenStore:
    return write_token_store(
        args.inputs,
        out,
        tokenizer=args.tokenizer,
        source_config=SourceConfig(format=args.format, decode_errors=args.decode_errors, split=args.split),
        tokenize_config=TokenizeConfig(
            kind=args.kind,
            text_key=args.text_key,
            append_eos=not args.no_eos,
            eos_id=args.eos_id,
            mask_prompt=not args.train_on_prompt,
            chat_template=args.chat_template,
            on_bad_record=args.on_bad_record,
            batch_size=args.batch_size,
        ),
        sample_format=args.sample_format,
        limit=args.limit,
        overwrite=args.overwrite,
        progress=args.progress,
        lock=lock,
    )


def _write_plots(store: TokenStore, plan: Any, skip: bool, out: Path) -> None:
    if skip:
        return
    if not has_module("matplotlib"):
        print("no plots: matplotlib is not installed (pip install 'thdpack[train]')")
        return
    from thdpack.data.stats_command import Row, plot

    for path in plot(store.lengths, [Row(plan.algorithm, plan.pack_size, 0.0, plan.stats)], out):
        print(f"wrote {path}")
