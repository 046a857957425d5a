"""Shared builders for the per-sequence CP placement tests: random placements (hypothesis), fixed
packs that mix every kind of entry, and THD batches laid out by them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
from hypothesis import strategies as st

from thdpack.cp.partition import rank_token_indices
from thdpack.layout.entries import CpLayout
from thdpack.layout.placement import PackPlacement
from thdpack.layout.rules import group_options
from thdpack.packing.packer import SampleTokens, assemble_pack
from thdpack.perf.time_cost import TimeCostModel
from thdpack.plan import PackPlan, plan_packs
from thdpack.thd.batch import thd_collate
from thdpack.thd.carriage import attach_meta
from thdpack.thd.cu import cu_from_lengths
from thdpack.thd.meta import EntryGroups, ThdMeta

CP_SIZES = [1, 2, 3, 4, 6, 8]


@st.composite
def placements(draw, max_sequences: int = 10, cp_sizes: Sequence[int] = CP_SIZES) -> PackPlacement:
    """A valid pack: random lengths, each on a random allowed group, budget = the fullest rank + slack."""
    cp = draw(st.sampled_from(cp_sizes))
    lengths = np.array(draw(st.lists(st.integers(1, 200), min_size=1, max_size=max_sequences)))
    size_O, start_O = group_options(cp)
    choice = np.array([draw(st.integers(0, len(size_O) - 1)) for _ in lengths])
    pack = PackPlacement(cp_size=cp, pack_size=cp, lengths_S=lengths, group_size_S=size_O[choice],
                         group_start_S=start_O[choice])  # fmt: skip
    budget = int(pack.rank_tokens().max()) + draw(st.integers(0, 7))
    return PackPlacement(cp_size=cp, pack_size=cp * budget, lengths_S=lengths, group_size_S=size_O[choice],
                         group_start_S=start_O[choice])  # fmt: skip


@st.composite
def batch_placements(draw, max_packs: int = 3, cp_sizes: Sequence[int] = CP_SIZES) -> list[PackPlacement]:
    """1..max_packs valid packs of one CP size and one pack size (a batch): ``placements`` each,
    then every pack given the largest budget among them."""
    cp = draw(st.sampled_from(cp_sizes))
    packs = draw(st.lists(placements(cp_sizes=[cp]), min_size=1, max_size=max_packs))
    pack_size = max(p.pack_size for p in packs)
    return [dataclasses.replace(p, pack_size=pack_size) for p in packs]


def _pack(lengths: list[int], groups: dict, cp: int, pack_size: int) -> PackPlacement:
    return PackPlacement.from_groups(lengths, groups, cp_size=cp, pack_size=pack_size)


MIXED_PACKS: dict[int, list[PackPlacement]] = {
    # cp 2 (budget 16): one sequence over both ranks, whole ones on each, a tail on each rank;
    # then an all-whole pack that fills both ranks (both padding entries empty)
    2: [
        _pack([11, 5, 3, 6], {(0, 2): [0], (0, 1): [1], (1, 1): [2, 3]}, 2, 32),
        _pack([16, 9, 7], {(0, 1): [0], (1, 1): [1, 2]}, 2, 32),
    ],
    # cp 3 (budget 12): split over all three (slots of 12 and 18), whole ones, an empty tail on rank 2
    3: [
        _pack([10, 4, 7, 2], {(0, 3): [0], (0, 1): [1], (1, 1): [2], (2, 1): [3]}, 3, 36),
        _pack([18, 6, 1], {(0, 3): [0], (2, 1): [1], (1, 1): [2]}, 3, 36),
    ],
    # cp 4 (budget 16): all-split, pair-split on both pairs, whole on every rank, tails of 1..7;
    # then a pack with an empty tail on rank 1 and no pair group
    4: [
        _pack(
            [13, 7, 5, 3, 2, 1, 9],
            {(0, 4): [0], (2, 2): [1], (0, 2): [6], (0, 1): [2], (1, 1): [3], (2, 1): [4], (3, 1): [5]},
            4,
            64,
        ),
        _pack([16, 4, 12, 1], {(0, 4): [0], (0, 1): [1], (1, 1): [2], (3, 1): [3]}, 4, 64),
    ],
}
"""Per CP size, two packs mixing whole, subgroup-split (cp 4) and all-split sequences with empty
and non-empty padding entries."""

WHOLE_PACKS: dict[int, list[PackPlacement]] = {
    2: [_pack([9, 3, 12], {(0, 1): [0, 1], (1, 1): [2]}, 2, 32)],
    4: [_pack([5, 9, 2, 16, 1], {(0, 1): [0], (1, 1): [1, 2], (2, 1): [3], (3, 1): [4]}, 4, 64)],
}
"""Packs with no split sequence (nothing to communicate)."""


def placed_metadata(packs: Sequence[PackPlacement]) -> dict:
    """The global THD metadata (``cu_seqlens``, ``cu_seqlens_padded``, ``max_seqlen``, record with the
    groups) of a batch of ``packs`` laid out by their placements, without tokens."""
    layout = CpLayout.concat([p.layout() for p in packs])
    groups = EntryGroups(layout.group_size_S, layout.group_start_S, packs[0].cp_size)
    meta = ThdMeta.from_lengths(layout.lengths_S, layout.slots_S, groups=groups)
    thd = {
        "cu_seqlens": cu_from_lengths(layout.lengths_S),
        "cu_seqlens_padded": cu_from_lengths(layout.slots_S),
        "max_seqlen": meta.max_seqlen,
    }
    attach_meta(thd, meta)
    return thd


def placed_batch(packs: Sequence[PackPlacement], seed: int = 0) -> dict:
    """The global THD batch (``thd_collate``) of ``packs`` filled with random tokens: every token id
    unique in the batch (1, 2, ...), so a token can be followed through a shard."""
    rng = np.random.default_rng(seed)
    built, next_id = [], 1
    for pack in packs:
        pieces = []
        for n in pack.lengths_S.tolist():
            ids = np.arange(next_id, next_id + n, dtype=np.int64)
            next_id += n
            labels = np.where(rng.random(n) < 0.2, -100, rng.integers(0, 1000, n))
            pieces.append(SampleTokens(ids, labels))
        built.append(assemble_pack(pieces, pack.pack_size, cp_size=pack.cp_size, pad_id=0, placement=pack))
    return thd_collate(built)


def shard_rows(thd: dict) -> torch.Tensor:
    """(T_local,) int64 global token indices of a shard (``thdpack.cp.partition.rank_token_indices``)."""
    return torch.tensor(rank_token_indices(thd["thd_meta"]))


def mixed_auto_plan(cp_size: int, pack_size: int) -> tuple[PackPlan, list[dict]]:
    """An ``auto`` plan (Llama 3 8B on H100) whose packs take both ways, and its samples.

    The lengths make the model split the choice: two sequences of about a whole pack, which only
    all ``cp_size`` ranks hold, and short ones under a rank's budget. With ``pack_size / cp_size``
    tokens per rank the host's eager ops outlast the kernels, so a pack of one long sequence takes
    the way with fewer ops: one all-to-all call rather than a ring of ``cp_size`` steps
    (``thdpack.perf.host``); a pack of short sequences runs them whole, exchanging nothing, which
    beats any all-to-all. Callers assert that the plan mixes: a model that decides otherwise fails.
    """
    timing = TimeCostModel.load("h100_sxm", "llama3-8b")
    short = np.random.default_rng(2).integers(1, pack_size // cp_size, 24)
    lengths = np.concatenate(([pack_size, pack_size - 3], short))
    plan = plan_packs(lengths, pack_size, cp_size=cp_size, cp_placement="auto", profile="h100_sxm",
                      model_shape="llama3-8b", overflow="split", timing=timing)  # fmt: skip
    return plan, [{"input_ids": list(range(1, n + 1))} for n in lengths.tolist()]
