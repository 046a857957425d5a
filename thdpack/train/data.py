"""The run's data: a cached token store, and the stream of optimizer steps cut from its packs.

Every rank plans the same packs (seeded by ``(packing.seed, epoch)``), so the global order of
packs needs no communication. Each step takes the next ``dp_size x micro_batches x
packs_per_micro_batch`` packs of that order (an epoch's last packs and the next epoch's first
may share a step: no pack is dropped or repeated), deals them to the DP ranks with balanced
work (``balance.deal``) and builds only this rank's packs. The stream's state is two integers,
so a resumed run continues with exactly the packs the uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from thdpack import __version__
from thdpack.data.prepare import write_token_store
from thdpack.data.sources import SourceConfig
from thdpack.data.store import TokenStore
from thdpack.data.tokenize import TokenizeConfig
from thdpack.packing.dataset import PackedDataset
from thdpack.packing.packer import Pack
from thdpack.train.balance import Imbalance, deal, imbalance, pack_costs
from thdpack.train.config import DataConfig

log = logging.getLogger(__name__)


def store_fingerprint(data: DataConfig) -> str:
    """A short hash of everything that decides the token store's content."""
    inputs = []
    for spec in data.inputs:
        if spec == "stdlib":
            inputs.append(f"stdlib:{sys.version_info[:3]}:{sysconfig.get_paths()['stdlib']}")
        else:
            path = Path(spec).expanduser().resolve()
            stat = path.stat() if path.exists() else None
            inputs.append(f"{path}:{stat.st_size if stat else '-'}:{stat.st_mtime_ns if stat else '-'}")
    key = {
        "inputs": inputs,
        "tokenizer": data.tokenizer,
        "format": data.format,
        "kind": data.kind,
        "limit": data.limit,
        "thdpack": __version__,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def open_token_store(data: DataConfig, *, is_local_main: bool, barrier: Any) -> TokenStore:
    """The run's token store, tokenized once per machine and cached in ``data.cache_dir``.

    The local main rank builds it into a temporary folder and renames it into place (atomic on
    one file system), while the other ranks wait at ``barrier``.
    """
    name = Path(data.inputs[0]).stem if data.inputs[0] != "stdlib" else "stdlib"
    path = Path(data.cache_dir).expanduser() / f"{name}-{data.tokenizer.replace('/', '_')}-{store_fingerprint(data)}"
    if is_local_main and not (path / "manifest.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        print(f"tokenizing {', '.join(data.inputs)} with {data.tokenizer} into {path} (once; cached)", flush=True)
        write_token_store(
            data.inputs,
            tmp,
            tokenizer=data.tokenizer,
            source_config=SourceConfig(format=data.format),
            tokenize_config=TokenizeConfig(kind=data.kind),
            limit=data.limit,
            overwrite=True,
        )
        try:
            tmp.rename(path)
        except OSError:  # another machine sharing the cache finished first
            shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    return TokenStore(path)


@dataclass(frozen=True)
class Step:
    """One optimizer step: this rank's micro-batches and the step's global counts."""

    epoch: int
    """Epoch of the step's first pack."""
    micro_batches: list[list[Pack]]
    """This DP rank's packs, ``micro_batches x packs_per_micro_batch``."""
    tokens: int
    """Real tokens of the whole step (all DP ranks)."""
    capacity: int
    """Token slots of the whole step (packs x pack_size)."""
    sequences: int
    """Sequences (pieces) of the whole step."""
    imbalance: Imbalance
    """max / mean work over the DP ranks."""


class StepStream:
    """Optimizer steps cut from the stream of every epoch's packs; stateful for exact resume."""

    def __init__(
        self,
        dataset: PackedDataset,
        *,
        dp_size: int,
        dp_rank: int,
        micro_batches: int,
        packs_per_micro_batch: int,
        balance: str,
    ) -> None:
        if dataset.config.world_size != 1:
            raise ValueError("StepStream deals packs itself: build the PackedDataset with world_size=1")
        self.dataset = dataset
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.micro_batches, self.packs_per_micro_batch = micro_batches, packs_per_micro_batch
        self.balance = balance
        self.packs_per_step = dp_size * micro_batches * packs_per_micro_batch
        self.epoch = 0
        self.position = 0  # next pack of `epoch`

    def _take(self) -> list[tuple[int, int]]:
        """The next step's (epoch, pack index) references, advancing the stream."""
        refs: list[tuple[int, int]] = []
        while len(refs) < self.packs_per_step:
            self.dataset.set_epoch(self.epoch)
            available = len(self.dataset) - self.position
            take = min(self.packs_per_step - len(refs), available)
            refs += [(self.epoch, self.position + i) for i in range(take)]
            self.position += take
            if self.position == len(self.dataset):
                self.epoch, self.position = self.epoch + 1, 0
        return refs

    def next_step(self) -> Step:
        refs = self._take()
        lengths = []
        for epoch, index in refs:
            self.dataset.set_epoch(epoch)
            lengths.append(self.dataset.pack_lengths(index))
        hands = deal(pack_costs(lengths, self.balance), self.dp_size)
        mine = sorted(hands[self.dp_rank], key=lambda k: refs[k])  # build epoch by epoch
        packs = []
        for k in mine:
            epoch, index = refs[k]
            self.dataset.set_epoch(epoch)
            packs.append(self.dataset[index])
        per_micro = self.packs_per_micro_batch
        return Step(
            epoch=refs[0][0],
            micro_batches=[packs[m * per_micro : (m + 1) * per_micro] for m in range(self.micro_batches)],
            tokens=int(sum(int(x.sum()) for x in lengths)),
            capacity=self.packs_per_step * self.dataset.config.pack_size,
            sequences=int(sum(len(x) for x in lengths)),
            imbalance=imbalance(lengths, hands),
        )

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands, plus the settings that define it (checked on load)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "packs_per_step": self.packs_per_step,
            "dataset": self.dataset.state_dict()["config"],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("packs_per_step", "dataset"):
            if state[key] != mine[key]:
                raise ValueError(
                    f"the checkpoint's data stream was made with other settings ({key}: saved {state[key]!r}, "
                    f"now {mine[key]!r}); resume with the same packing, data and batch settings"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def pad_id_of(store: TokenStore) -> int:
    """The padding token: the tokenizer's EOS when the store knows it (its label is -100 anyway)."""
    eos = store.manifest.get("tokenizer", {}).get("eos_id")
    return int(eos) if eos is not None else 0


def real_lengths_summary(lengths: np.ndarray) -> str:
    return (
        f"{len(lengths):,} samples, {int(lengths.sum()):,} tokens, lengths min {int(lengths.min()):,} / "
        f"median {int(np.median(lengths)):,} / max {int(lengths.max()):,}"
    )
