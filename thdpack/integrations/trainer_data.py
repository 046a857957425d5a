"""Hugging Face examples as thdpack samples, the trainers' ``PackedDataset`` of them, and the loader
that gives a ``Trainer`` this rank's CP shard of every micro-batch of thdpack's step stream.

Hugging Face keeps ``labels`` aligned with ``input_ids`` (the model's loss shifts them); thdpack's
samples hold each position's target (:func:`thdpack_sample` converts). :func:`packed_step_loader`
serves the Trainer's micro-batches from ``PackedDataset.step_stream``: its batch sampler yields only
``(step, micro-batch)`` references and the stream builds a step when its first micro-batch is
fetched, so the micro-batches the Trainer skips on resume are never built.

Legend: ``T`` tokens of a micro-batch on this rank (a CP shard).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from thdpack.cp.partition import shard
from thdpack.cp.topology import CpTopology
from thdpack.layout.rules import IGNORE_INDEX
from thdpack.packing.dataset import PackedDataset, PackedDatasetConfig
from thdpack.packing.packer import check_token_ids
from thdpack.packing.runtime import PackingRuntime
from thdpack.packing.step_stream import StepStream, StreamChange
from thdpack.perf.time_cost import timing_of
from thdpack.thd.batch import thd_collate, thd_to_device
from thdpack.thd.format import THDBatch

STEP_KEY = "thdpack_step"
"""Micro-batch key: the index ``k`` of its optimizer step in the stream (0-based)."""
MICRO_BATCH_KEY = "thdpack_micro_batch"
"""Micro-batch key: its index ``m`` within the step."""
STEP_LABELS_KEY = "thdpack_step_labels"
"""Micro-batch key: this rank's (T,) labels of every micro-batch of the step, for ``StepLoss.begin``."""


def thdpack_sample(example: Mapping[str, Any], index: int, vocab_size: int | None = None) -> dict[str, np.ndarray]:
    """A Hugging Face example (``input_ids``, optional unshifted ``labels``) as a thdpack sample.

    Args:
        example: ``input_ids`` (L,) integers; ``labels`` (L,) integers aligned with them, -100 on
            tokens that are no target (prompt, user turns); without ``labels`` every next token is
            a target. An ``attention_mask`` must be all ones (one unpadded example per row).
        index: the example's index, named in errors.
        vocab_size: the model's vocabulary: an id (or label) outside it is a ``ValueError`` naming
            the example and the position, here rather than as an ``IndexError`` in the embedding
            (a device-side assert on CUDA, and a gloo "Connection closed" from the other ranks).

    Returns:
        ``{"input_ids": (L,) int64, "labels": (L,) int64}`` with ``labels[t]`` the target of
        ``input_ids[t]``; without ``labels`` only ``input_ids`` (thdpack derives the targets).

    >>> thdpack_sample({"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}, 0)["labels"].tolist()
    [-100, 7, 8, -100]
    """
    input_ids = np.asarray(example["input_ids"], dtype=np.int64)
    mask = example.get("attention_mask")
    if mask is not None and not np.all(np.asarray(mask) == 1):
        zeros = int(np.sum(np.asarray(mask) == 0))
        raise ValueError(
            f"example {index} has {zeros} padding tokens (attention_mask == 0); thdpack packs unpadded examples: "
            "tokenize without padding"
        )
    check_token_ids(input_ids, f"example {index}", "input_ids", vocab_size=vocab_size)
    labels = example.get("labels")
    if labels is None:
        return {"input_ids": input_ids}
    labels = np.asarray(labels, dtype=np.int64)
    if labels.shape != input_ids.shape:
        raise ValueError(
            f"example {index}: labels has {labels.size} tokens but input_ids has {input_ids.size}; Hugging Face "
            "labels are aligned with input_ids (the loss shifts them)"
        )
    check_token_ids(labels, f"example {index}", "labels", vocab_size=vocab_size, ignored=IGNORE_INDEX)
    shifted = np.full_like(labels, IGNORE_INDEX)
    shifted[:-1] = labels[1:]
    return {"input_ids": input_ids, "labels": shifted}


class HFSamples(Sequence[dict[str, np.ndarray]]):
    """A read-only view of a Hugging Face dataset (or any sequence of examples) as thdpack samples.

    ``datasets.Dataset`` columns other than ``input_ids``, ``labels`` and ``attention_mask`` are
    not read. Nothing is copied up front: ``samples[i]`` converts example ``i`` when a pack needs it.
    """

    def __init__(self, dataset: Any, *, vocab_size: int | None = None) -> None:
        if dataset is None or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise ValueError(
                f"the training dataset is a {type(dataset).__name__}; thdpack plans packs over every example's "
                "length up front: pass a map-style dataset (a datasets.Dataset or a list of examples), not a stream"
            )
        columns = getattr(dataset, "column_names", None)
        if columns is not None:
            if "input_ids" not in columns:
                raise ValueError(
                    f"the training dataset has no 'input_ids' column (columns: {columns}); tokenize it first"
                )
            dataset = dataset.select_columns([c for c in ("input_ids", "labels", "attention_mask") if c in columns])
        self.dataset = dataset
        self.vocab_size = vocab_size
        """The model's vocabulary, which every id must stay below (None: not checked)."""

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:  # type: ignore[override]
        return thdpack_sample(self.dataset[int(index)], int(index), self.vocab_size)

    def lengths(self) -> np.ndarray:
        """(N,) int64 token counts of every example: from the Arrow column's list lengths for a
        ``datasets.Dataset`` (in its row order, a shuffle's included; nothing decoded), else one
        pass over the examples."""
        if hasattr(self.dataset, "with_format"):
            import pyarrow.compute as pc

            column = self.dataset.with_format("arrow")["input_ids"]
            return pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
        return np.fromiter((len(ex["input_ids"]) for ex in self.dataset), dtype=np.int64, count=len(self.dataset))

    @functools.cached_property
    def sha256(self) -> str:
        """sha256 of what thdpack reads of every example, in row order: for ``input_ids`` and then
        ``labels``, the key, every example's token count (-1 for an example without the key) and
        the tokens, all as little-endian int64. The same examples give the same digest as a
        ``datasets.Dataset`` (read from its Arrow columns, chunk by chunk) or as a list. Computed
        once, when a checkpoint first records it."""
        sha = hashlib.sha256()
        for key in ("input_ids", "labels"):
            sha.update(key.encode())
            counts, chunks = self._column(key)
            sha.update(np.ascontiguousarray(counts, dtype="<i8").tobytes())
            for chunk in chunks:
                sha.update(np.ascontiguousarray(chunk, dtype="<i8").tobytes())
        return sha.hexdigest()

    def _column(self, key: str) -> tuple[np.ndarray, Iterator[np.ndarray]]:
        """(N,) token counts of ``key`` in every example (-1: absent) and its tokens, in chunks."""
        columns = getattr(self.dataset, "column_names", None)
        if columns is None:
            values = [self.dataset[i].get(key) for i in range(len(self.dataset))]
            counts = np.array([-1 if v is None else len(v) for v in values], dtype=np.int64)
            return counts, (np.asarray(v, dtype=np.int64) for v in values if v is not None)
        if key not in columns:
            return np.full(len(self.dataset), -1, dtype=np.int64), iter(())
        import pyarrow.compute as pc

        column = self.dataset.with_format("arrow")[key]
        counts = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
        chunks = getattr(column, "chunks", [column])
        return counts, (pc.list_flatten(c).to_numpy(zero_copy_only=False) for c in chunks)

    def identity(self) -> dict[str, Any]:
        """What a checkpoint records of the data (and a resume compares): the examples and their digest."""
        return {"examples": len(self), "sha256": self.sha256}

    def check_token_ids(self) -> None:
        """``ValueError`` naming the first example and position whose id or label is outside
        ``vocab_size``. Up front, on every rank alike: so all ranks stop together with the reason,
        instead of one in the embedding mid-step and the others on a closed connection. A
        ``datasets.Dataset`` is scanned in Arrow (its columns' minimum and maximum, nothing decoded);
        only on a failure, or for other datasets, are examples converted one by one."""
        if self.vocab_size is None:
            return
        if hasattr(self.dataset, "with_format") and self._arrow_ids_fit():
            return
        for index in range(len(self)):
            self[index]  # thdpack_sample raises naming the example and the position

    def _arrow_ids_fit(self) -> bool:
        import pyarrow.compute as pc

        table = self.dataset.with_format("arrow")
        for key in ("input_ids", "labels"):
            if key not in self.dataset.column_names:
                continue
            values = pc.list_flatten(table[key])
            if key == "labels":
                values = pc.filter(values, pc.not_equal(values, IGNORE_INDEX))
            low_high = pc.min_max(values)
            low, high = low_high["min"].as_py(), low_high["max"].as_py()
            if low is not None and (low < 0 or high >= self.vocab_size):
                return False
        return True


class StepSource(Dataset):
    """Micro-batch ``(k, m)`` of the stream: this rank's CP shard of micro-batch ``m`` of step ``k``.

    Steps are built in order, each once, when their first micro-batch is asked for; asking for any
    other step than the current or the next one raises (the Trainer and the stream disagree about
    where training stands). ``len()`` is the number of examples (the Trainer logs it).
    """

    def __init__(
        self,
        stream: StepStream,
        *,
        cp_size: int,
        cp_rank: int,
        device: torch.device,
        num_examples: int,
        steps_done: int = 0,
        data: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        self.stream = stream
        self.cp_size, self.cp_rank, self.device = cp_size, cp_rank, device
        self.num_examples = num_examples
        self.data = data
        """The data's identity (``HFSamples.identity``), recorded with the state; called when saving."""
        self.steps_done = steps_done
        """Steps the stream has built: the index of the next one."""
        self._micro: list[THDBatch] = []

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, ref: tuple[int, int]) -> THDBatch:  # type: ignore[override]
        step, micro = ref
        if step == self.steps_done:
            self._build_next()
        elif step != self.steps_done - 1 or not self._micro:
            raise RuntimeError(
                f"the Trainer asked for micro-batch {micro} of step {step}, but thdpack's pack stream has built "
                f"{self.steps_done} steps; resume from the checkpoint the stream state was saved with, and leave "
                "ignore_data_skip at False"
            )
        return self._micro[micro]

    def _build_next(self) -> None:
        step = self.stream.next_step()
        shards = [
            thd_to_device(shard(thd_collate(packs), self.cp_size, self.cp_rank), self.device)
            for packs in step.micro_batches
        ]
        labels = [mb["labels"] for mb in shards]
        k = self.steps_done
        self._micro = [{**mb, STEP_KEY: k, MICRO_BATCH_KEY: m, STEP_LABELS_KEY: labels} for m, mb in enumerate(shards)]
        self.steps_done += 1

    def state_dict(self) -> dict[str, Any]:
        """Steps built, the stream's state after them (its arrays under ``"arrays"``, as
        ``thdpack.files.state_file`` writes them) and the data's identity: what a checkpoint saves."""
        stream = self.stream.state_dict()
        arrays = stream.pop("arrays")
        out = {"steps_done": self.steps_done, "stream": stream, "arrays": arrays}
        if self.data is not None:
            out["data"] = dict(self.data())
        return out

    def load_state_dict(self, state: Mapping[str, Any], *, names: Mapping[str, str] | None = None) -> StreamChange:
        """Continue after ``state["steps_done"]`` steps, from the stream's saved position with this
        stream's settings (``StepStream.load_state_dict``, ``names`` for its message and errors)."""
        change = self.stream.load_state_dict({**state["stream"], "arrays": state.get("arrays", {})}, names=names)
        self.steps_done = int(state["steps_done"])
        self._micro = []
        return change


class StepSampler(Sampler[list[tuple[int, int]]]):
    """Trainer epoch ``e``: the references ``[(k, m)]`` of steps ``e*S .. e*S + S - 1``, ``m < micro_batches``.

    >>> sampler = StepSampler(steps_per_epoch=2, micro_batches=2)
    >>> sampler.set_epoch(1)
    >>> list(sampler)
    [[(2, 0)], [(2, 1)], [(3, 0)], [(3, 1)]]
    """

    def __init__(self, *, steps_per_epoch: int, micro_batches: int, epoch: int = 0) -> None:
        self.steps_per_epoch, self.micro_batches, self.epoch = steps_per_epoch, micro_batches, epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps_per_epoch * self.micro_batches

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        first = self.epoch * self.steps_per_epoch
        for k in range(first, first + self.steps_per_epoch):
            for m in range(self.micro_batches):
                yield [(k, m)]


class PackedStepLoader(DataLoader):
    """The Trainer's train data loader over a :class:`StepSource` (batches of one reference)."""

    def set_epoch(self, epoch: int) -> None:
        """Called by the Trainer at each epoch: which steps of the stream the epoch covers."""
        self.batch_sampler.set_epoch(epoch)


def _single(batch: list[THDBatch]) -> THDBatch:
    return batch[0]


def packed_step_loader(source: StepSource, *, steps_per_epoch: int, micro_batches: int) -> PackedStepLoader:
    """A data loader of ``steps_per_epoch * micro_batches`` micro-batches per Trainer epoch.

    Built in the training process (no workers): a step's packs are built once, in order, and the
    stream's position is the one the Trainer saves with its checkpoint. A resumed ``source``
    starts the sampler at the epoch its next step belongs to.
    """
    sampler = StepSampler(
        steps_per_epoch=steps_per_epoch, micro_batches=micro_batches, epoch=source.steps_done // steps_per_epoch
    )
    return PackedStepLoader(source, batch_sampler=sampler, collate_fn=_single, num_workers=0)


def packed_dataset(
    config: PackedDatasetConfig,
    samples: HFSamples,
    topology: CpTopology,
    *,
    pad_id: int,
    lengths: np.ndarray,
) -> PackedDataset:
    """The trainers' ``PackedDataset``: ``config`` for this process's place in dp x cp.

    Under CP with ``config.plan.cp_placement == "adaptive"`` its packs carry their placement
    (``cp_group_size`` / ``cp_group_start`` per entry), which ``cp.shard`` and thdpack's attention
    follow, over the topology's placement groups.
    """
    timing = timing_of(config.plan, topology.gpus_per_node)  # a timed plan's machine and model, on these nodes
    return config.build(samples, PackingRuntime.from_topology(topology, pad_id=pad_id, timing=timing), lengths=lengths)
