"""Megatron-LM's two sequence-packing schedulers, re-implemented from their public rules, as mesh runs.

``dp_balanced`` (``DpBalancedScheduler``) packs each global batch next-fit and deals the packs
round robin to the data-parallel ranks, each sample split over its CP group; ``dynamic_cp``
(``DefaultDynamicCPScheduler``) gives every sample the smallest power-of-2 group that holds it and
balances the groups' work per micro-batch. Samples are padded as Megatron's varlen dataset pads
them. They are the baseline ``benchmarks/mesh_sim.py --megatron`` checks the step model against;
docs/design/step_model.md ("Megatron-LM's schedulers") states the rules as implemented.

>>> dp_balanced([3000, 3000, 3000, 500, 100, 7000], dp=2, cp=2, max_seqlen_per_rank=4096)  # packs <= 8192
[[[0, 1], [2, 3]], [[5], [4]]]
>>> dynamic_cp([5000, 1500, 1200, 900], world=4, max_seqlen_per_rank=2048)   # 5000 needs 4 ranks
[[[0], [0], [0], [0]], [[1], [1], [2], [3]]]

Legend: ``W`` ranks of the mesh.
"""

from __future__ import annotations

import itertools
import math
from collections import deque

import numpy as np

from thdpack.perf.host import MEGATRON_TE
from thdpack.perf.mesh import COMMS, MeshRun
from thdpack.perf.step import TrainingSpec
from thdpack.plan.ordered import next_fit

SCHEDULERS: tuple[str, ...] = ("dp_balanced", "dynamic_cp")
MEGATRON_SPEC = TrainingSpec(grad_itemsize=2, overlap_dp=False, host=MEGATRON_TE)
"""How ``benchmark_dcp.sh`` trains: bf16 gradients all-reduced after the backward (no
``--overlap-grad-reduce``, no ``--accumulate-allreduce-grads-in-fp32``), Adam not distributed,
Megatron-LM's GPT on Transformer Engine issuing the host's ops (``thdpack.perf.host.MEGATRON_TE``)."""


def lognormal_lengths(
    n: int, *, mean: float = 1024.0, sigma: float = 1.5, low: int = 128, high: int = 8192, seed: int = 0
) -> np.ndarray:
    """(n,) int64 lengths of Megatron's mock varlen dataset: a lognormal whose *unclipped* mean is
    ``mean`` (``mu = ln(mean) - sigma^2 / 2``) and whose log has standard deviation ``sigma``,
    clipped to ``[low, high]`` and truncated to integers (``MockSFTLowLevelDataset``)."""
    mu = math.log(mean) - sigma**2 / 2
    draws = np.random.default_rng(seed).lognormal(mu, sigma, n)
    return np.clip(draws, low, high).astype(np.int64)


def sample_tokens(lengths: np.ndarray, granularity: int) -> np.ndarray:
    """Tokens a sample of ``lengths`` (EOD included) occupies: the ``length - 1`` input tokens
    after the label shift, padded up to a multiple of ``granularity``."""
    inputs = np.asarray(lengths, dtype=np.int64) - 1
    return -(-inputs // granularity) * granularity


def dp_balanced(
    lengths: list[int] | np.ndarray, *, dp: int, cp: int, max_seqlen_per_rank: int
) -> list[list[list[int]]]:
    """``[micro-batch][dp rank] -> sample indices`` of Megatron's ``dp_balanced`` scheduler for one
    global batch of (padded) ``lengths`` in order."""
    offsets = next_fit(np.asarray(lengths, dtype=np.int64), cp * max_seqlen_per_rank).tolist()
    packs = [list(range(a, b)) for a, b in itertools.pairwise(offsets)]
    missing = -len(packs) % dp
    i = len(packs) - 1
    while missing:
        if i < 0:
            raise ValueError(f"{len(lengths)} samples cannot fill a multiple of dp={dp} packs")
        if len(packs[i]) > 1:
            packs.append([packs[i].pop()])
            missing -= 1
        else:
            i -= 1
    return [[packs[m * dp + d] for d in range(dp)] for m in range(len(packs) // dp)]


def group_size_needed(length: int, max_seqlen_per_rank: int, min_size: int = 1) -> int:
    """The smallest power-of-2 group holding ``length`` tokens at ``max_seqlen_per_rank`` per rank."""
    return max(min_size, 1 << max(0, math.ceil(math.log2(length / max_seqlen_per_rank))))


def dynamic_cp(
    lengths: list[int] | np.ndarray, *, world: int, max_seqlen_per_rank: int, min_size: int = 1
) -> list[list[list[int]]]:
    """``[micro-batch][rank] -> sample indices`` of Megatron's dynamic-CP scheduler for one global
    batch of (padded) ``lengths``; a sample is on every rank of its group (consecutive ranks)."""
    need = [group_size_needed(int(x), max_seqlen_per_rank, min_size) for x in lengths]
    if max(need, default=1) > world:
        i = int(np.argmax(need))
        raise ValueError(
            f"sample {i} has {int(lengths[i])} tokens, which needs a group of {need[i]} ranks at "
            f"max_seqlen_per_rank={max_seqlen_per_rank}, more than the {world} ranks of the mesh"
        )
    remaining = sorted(range(len(lengths)), key=lambda i: -int(lengths[i]))
    micro_batches = []
    while remaining:
        placed, remaining = _dcp_micro_batch(remaining, lengths, need, world, max_seqlen_per_rank)
        micro_batches.append(placed)
    return micro_batches


def _dcp_buckets(samples: list[int], lengths, need: list[int]) -> list[deque[int]]:
    """The samples (longest first) cut into one bucket per group size, of about equal work."""
    work = [int(lengths[i]) ** 2 / need[i] for i in samples]
    k = len({need[i] for i in samples})
    target = sum(work) / k
    buckets: list[deque[int]] = []
    current: list[int] = []
    current_work = 0.0
    left = k
    for position, (i, w) in enumerate(zip(samples, work, strict=True)):
        # Megatron counts the buckets still to fill as (left - closed), both shrinking per bucket
        if current and (current_work + w > 1.1 * target or len(samples) - position <= left - len(buckets)):
            buckets.append(deque(current))
            current, current_work = [], 0.0
            left -= 1
        current.append(i)
        current_work += w
    if current:
        buckets.append(deque(current))
    return buckets


def _dcp_micro_batch(
    samples: list[int], lengths, need: list[int], world: int, cap: int
) -> tuple[list[list[int]], list[int]]:
    """One micro-batch of ``samples`` (longest first): ``(per-rank sample lists, leftovers)``."""
    buckets = _dcp_buckets(samples, lengths, need)
    load = [0.0] * world
    held: list[list[int]] = [[] for _ in range(world)]
    group_of: list[int | None] = [None] * world
    members: dict[int, list[int]] = {}
    packed: dict[int, float] = {}
    first_need = None
    smaller_used = False
    while buckets:
        free = [r for r in range(world) if group_of[r] is None]
        pick = next(
            (
                b
                for b, bucket in enumerate(buckets)
                if bucket and (len(free) >= need[bucket[0]] or any(len(m) == need[bucket[0]] for m in members.values()))
            ),
            None,
        )
        if pick is None:
            break
        sample = buckets[pick][0]
        size, length = need[sample], int(lengths[sample])
        first_need = size if first_need is None else first_need
        open_groups = [gid for gid, m in members.items() if len(m) == size and packed[gid] + length / size <= cap]
        best, best_load = None, math.inf
        for gid in open_groups:  # the least-loaded group with room, the first on ties
            group_load = max(load[r] for r in members[gid])
            if group_load < best_load:
                best, best_load = gid, group_load
        if len(free) >= size:
            lightest = sorted(free, key=lambda r: load[r])[:size]
            if load[lightest[-1]] < best_load:
                best = len(members)
                members[best], packed[best] = lightest, 0.0
                for r in lightest:
                    group_of[r] = best
        elif best is None:
            break
        packed[best] += length / size
        for r in members[best]:
            held[r].append(sample)
            load[r] += length**2 / size
        buckets[pick].popleft()
        while buckets and not buckets[0]:
            buckets.pop(0)
        smaller_used |= size < first_need
        if smaller_used and buckets and max(load) - min(load) <= 0.05 * max(load):
            break
    leftovers = [i for bucket in buckets for i in bucket]
    while any(not h for h in held):
        held, members = _grow_smallest_group(held, members, world)
    return held, leftovers


def _grow_smallest_group(
    held: list[list[int]], members: dict[int, list[int]], world: int
) -> tuple[list[list[int]], dict[int, list[int]]]:
    """Megatron's fill of empty ranks: the first smallest group doubles onto the ranks after it,
    the groups after it shifting right into the empty ranks."""
    smallest = min(len(m) for m in members.values())
    grow = min(2 * smallest, world) - smallest
    gid = next(g for g, m in members.items() if len(m) == smallest)
    start, end = members[gid][0], members[gid][-1]
    empty = next(r for r, h in enumerate(held) if not h)
    new: list[list[int]] = [[] for _ in range(world)]
    new[:start] = held[:start]
    for r in range(start, end + grow + 1):
        new[r] = held[end]
    for i, h in enumerate(held[end + 1 : empty]):
        new[end + grow + 1 + i] = h
    members = {
        g: (list(range(start, end + grow + 1)) if g == gid else [r + grow for r in m] if g > gid else m)
        for g, m in members.items()
    }
    return new, members


def scheduler_run(
    scheduler: str,
    lengths: np.ndarray,
    *,
    dp: int,
    cp: int,
    micro_batches: int,
    max_seqlen_per_rank: int,
) -> MeshRun:
    """The mesh run of ``scheduler`` (``SCHEDULERS``) over ``lengths`` (sample lengths, EOD
    included), ``dp x micro_batches`` samples per global batch (the remainder dropped), samples
    padded as Megatron pads them (``sample_tokens``)."""
    if scheduler not in SCHEDULERS:
        raise ValueError(f"unknown Megatron scheduler {scheduler!r}; valid: {', '.join(SCHEDULERS)}")
    world = dp * cp
    per_step = dp * micro_batches
    steps = len(lengths) // per_step
    if steps == 0:
        raise ValueError(f"{len(lengths)} samples do not fill one global batch of dp x micro_batches = {per_step}")
    granularity = 2 * cp * (dp if scheduler == "dynamic_cp" else 1)
    padded = sample_tokens(lengths[: steps * per_step], granularity).reshape(steps, per_step)
    groups: list[tuple[int, int, int, int]] = []  # (step, round, first rank, size)
    entries: list[tuple[int, int]] = []  # (group, tokens)
    for s in range(steps):
        batch = padded[s]
        if scheduler == "dp_balanced":
            for m, hands in enumerate(dp_balanced(batch, dp=dp, cp=cp, max_seqlen_per_rank=max_seqlen_per_rank)):
                for d, pack in enumerate(hands):
                    groups.append((s, m, d * cp, cp))
                    entries += [(len(groups) - 1, int(batch[i])) for i in pack]
        else:
            schedule = dynamic_cp(batch, world=world, max_seqlen_per_rank=max_seqlen_per_rank)
            for m, ranks in enumerate(schedule):
                r = 0
                while r < world:  # a group: the consecutive ranks holding the same samples
                    size = next((k for k in range(1, world - r + 1) if r + k == world or ranks[r + k] != ranks[r]), 1)
                    groups.append((s, m, r, size))
                    entries += [(len(groups) - 1, int(batch[i])) for i in ranks[r]]
                    r += size
    group = np.array(groups, dtype=np.int64).reshape(-1, 4)
    entry = np.array(entries, dtype=np.int64).reshape(-1, 2)
    rounds = int(group[:, 1].max()) + 1
    tokens = np.zeros((steps, rounds, world))
    per_rank = np.bincount(entry[:, 0], weights=entry[:, 1], minlength=len(group)) / group[:, 3]
    for (s, m, first, size), t in zip(group.tolist(), per_rank.tolist(), strict=True):
        tokens[s, m, first : first + size] = t
    comm = np.where(group[:, 3] == 1, COMMS.index("whole"), COMMS.index("ring"))
    return MeshRun(
        world=world,
        steps=steps,
        rounds=rounds,
        group_step=group[:, 0],
        group_round=group[:, 1],
        group_first=group[:, 2],
        group_size=group[:, 3],
        group_comm=comm,
        entry_group=entry[:, 0],
        entry_length=entry[:, 1],
        tokens=tokens,
    )
