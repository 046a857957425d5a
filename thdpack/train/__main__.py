"""Hydra training entry.

    python -m thdpack.train parallel.cp_size=1                # one process (CPU or one GPU)
    torchrun --nproc-per-node 2 -m thdpack.train              # the default: cp_size 2, stdlib corpus
    torchrun --nproc-per-node 4 -m thdpack.train parallel.cp_size=2 train.steps=200 packing.pack_size=2048
    torchrun --nproc-per-node 2 -m thdpack.train train.resume=true   # continue from the last checkpoint

``configs/train.yaml`` composes the groups over the typed schema of ``thdpack.train.config``.
Exit codes: 0 done, 2 a bad setting or input (named, with the fix), 1 a failure while training.
A fatal signal prints every thread's Python stack first (``faulthandler``).
"""

from __future__ import annotations

import dataclasses
import difflib
import faulthandler
import logging
import os
import sys
from pathlib import Path
from typing import Any

from thdpack._optional import require

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
REMOVED_KEYS = {"train.dtype": "use train.precision=fp32, bf16-mixed or fp64"}
"""Settings that no longer exist, and what replaces them (Hydra's own refusal suggests ``+key=``,
which fails as well)."""


def removed_setting(argv: list[str]) -> str | None:
    """The message for the first override in ``argv`` that sets a removed key, else None.

    >>> removed_setting(["train.steps=3", "+train.dtype=bfloat16"])
    'train.dtype was removed: use train.precision=fp32, bf16-mixed or fp64'
    """
    for arg in argv:
        key = arg.split("=", 1)[0].lstrip("+~")
        if key in REMOVED_KEYS:
            return f"{key} was removed: {REMOVED_KEYS[key]}"
    return None


def unknown_setting(cfg: Any) -> str | None:
    """The message for the first key of the composed config ``cfg`` that its schema lacks, else None.

    Hydra adds a ``+key=value`` override to a typed node, and OmegaConf then hands the key to no
    field: the run would go on with the default (``+packing.cp_placment=te`` would train with
    ``cp_placement=adaptive``). The message names the closest valid key.
    """
    from omegaconf import DictConfig, OmegaConf

    todo: list[tuple[str, Any]] = [("", cfg)]
    while todo:
        prefix, node = todo.pop(0)
        schema = OmegaConf.get_type(node)  # a node set to null has no dataclass type
        if not dataclasses.is_dataclass(schema):
            continue
        fields = [f.name for f in dataclasses.fields(schema)]
        for key in node:
            if key not in fields:
                close = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.6)
                where = prefix.rstrip(".") or "the run"
                hint = f"did you mean {prefix}{close[0]}?" if close else f"{where} has: {', '.join(fields)}"
                return f"{prefix}{key} is not a setting ({hint}); a key added with + must be one the schema has"
            child = node._get_node(key)  # the node itself: reading the value would resolve interpolations
            if isinstance(child, DictConfig):
                todo.append((f"{prefix}{key}.", child))
    return None


def main() -> None:
    removed = removed_setting(sys.argv[1:])
    if removed is not None:
        print(f"thdpack.train: bad config: {removed}", file=sys.stderr)
        sys.exit(2)
    faulthandler.enable(all_threads=True)  # a SIGBUS / SIGSEGV prints where every thread was
    require("hydra", "python -m thdpack.train")
    import hydra
    from omegaconf import DictConfig, OmegaConf

    from thdpack.train.checkpoint import CheckpointSaveError
    from thdpack.train.config import register_configs
    from thdpack.train.runtime import RankTimeoutError
    from thdpack.train.trainer import run

    register_configs()
    has_yaml = (CONFIG_DIR / "train.yaml").exists()

    @hydra.main(
        version_base=None,
        config_path=str(CONFIG_DIR) if has_yaml else None,
        config_name="train" if has_yaml else "train_schema",
    )
    def entry(cfg: DictConfig) -> None:
        is_main = int(os.environ.get("RANK", "0")) == 0
        logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, format="%(name)s: %(message)s")
        unknown = unknown_setting(cfg)
        if unknown is not None:
            print(f"thdpack.train: bad config: {unknown}", file=sys.stderr)
            sys.exit(2)
        try:
            config = OmegaConf.to_object(cfg)  # runs every config's __post_init__ checks
        except ValueError as err:
            print(f"thdpack.train: bad config: {err}", file=sys.stderr)
            sys.exit(2)
        try:
            run(config, config_text=OmegaConf.to_yaml(cfg))
        except ValueError as err:
            print(f"thdpack.train: error: {err}", file=sys.stderr)
            sys.exit(2)
        except (FloatingPointError, CheckpointSaveError, RankTimeoutError) as err:
            print(f"thdpack.train: error: {err}", file=sys.stderr)
            sys.exit(1)

    entry()


if __name__ == "__main__":
    main()
