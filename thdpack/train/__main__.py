"""Hydra training entry.

    python -m thdpack.train parallel.cp_size=1                # one process (CPU or one GPU)
    torchrun --nproc-per-node 2 -m thdpack.train              # the default: cp_size 2, stdlib corpus
    torchrun --nproc-per-node 4 -m thdpack.train parallel.cp_size=2 train.steps=200 packing.pack_size=2048
    torchrun --nproc-per-node 2 -m thdpack.train train.resume=true   # continue from the last checkpoint

Configs: ``configs/train.yaml`` composes the groups ``data model packing parallel attention
train`` (``configs/<group>/*.yaml``) over the typed schema in ``thdpack.train.config``.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from thdpack._optional import require

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def main() -> None:
    require("hydra", "python -m thdpack.train")
    import hydra
    from omegaconf import DictConfig, OmegaConf

    from thdpack.train.config import register_configs
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
        try:
            config = OmegaConf.to_object(cfg)  # runs every config's __post_init__ checks
        except ValueError as err:
            print(f"thdpack.train: bad config: {err}", file=sys.stderr)
            sys.exit(2)
        out = Path(config.train.output_dir)
        checkpoints = out / "checkpoints"
        refused = (
            checkpoints.is_dir() and any(checkpoints.iterdir()) and not (config.train.resume or config.train.overwrite)
        )
        if is_main and not refused:  # a run the trainer refuses must not overwrite the earlier run's config
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        try:
            run(config)
        except ValueError as err:
            print(f"thdpack.train: error: {err}", file=sys.stderr)
            sys.exit(2)

    entry()


if __name__ == "__main__":
    main()
