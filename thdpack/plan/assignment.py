"""Turn a histogram plan (templates x counts) into concrete packs of item indices.

Items of equal size are interchangeable, so assignment is O(n) vectorised work. The plan's
*slots* are laid out in size order: for each size, the slots of every (group, template node)
pair that holds that size ("blocks"), and ``slot_targets`` says where each slot sits in the flat
output. The k-th item of size s (in item order, or in a seeded shuffle) fills the k-th slot of
size s. Items are ranked in chunks that fit the CPU cache, so 100M items cost ~100x 1M items.
Nothing here is sized by the pack capacity: above 2**16 slots a pack, items are ranked by the
rank of their size among the plan's distinct sizes instead of by the size itself.

>>> from thdpack.plan.size_classes import plan_histogram
>>> sizes = np.array([3, 5, 1, 3, 4, 5])
>>> hp = plan_histogram(np.bincount(sizes, minlength=11), capacity=10)
>>> indices, offsets = materialize(hp, sizes)
>>> [sizes[indices[a:b]].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
[[5, 5], [4, 3, 3], [1]]
>>> [indices[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
[[1, 5], [4, 0, 3], [2]]
"""

from __future__ import annotations

import numpy as np

from thdpack.plan.histogram_plan import HistogramPlan

CHUNK = 1 << 16  # items ranked per step: numpy calls amortised, a chunk's sort stays in the CPU cache
SIZE_KEYS_BELOW = 1 << 16
"""Capacities below this (at most 2**16) rank items by their size (16-bit keys, sorted by radix,
counted in a capacity-long histogram); larger ones by their size's rank among the plan's
distinct sizes (one more gather per item, nothing capacity-long)."""


def pack_offsets(hp: HistogramPlan) -> np.ndarray:
    """(num_packs+1,) int64 boundaries of the packs in the flat output, groups in plan order."""
    items_per_pack = hp.node_items()[hp.group_node]
    offsets = np.empty(hp.num_packs + 1, dtype=np.int64)
    offsets[0] = 0
    np.cumsum(np.repeat(items_per_pack, hp.group_count), out=offsets[1:])
    return offsets


def slot_targets(hp: HistogramPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(targets, slot_sizes, slot_counts)``: (n,) flat output position of every slot, slots
    ordered by size (ascending); (K,) int64 the distinct slot sizes, ascending; (K,) int64 the
    slots of each.

    A block ``(group g, node a)`` holds ``m = count[g]`` packs x ``r = reps[a]`` slots; slot
    ``k`` goes to pack ``k % m`` of the group, at the node's position in the pack plus ``k // m``.
    Consecutive slots are then one pack (``stride`` items) apart except at the block's ``r``
    run starts, so the targets are a running sum of a piecewise-constant step plus a few point
    corrections: two cumulative sums instead of per-slot arithmetic.
    """
    items_at = hp.node_items()
    leaf, count = hp.group_node, hp.group_count
    items_per_pack = items_at[leaf]
    group_start = np.cumsum(count * items_per_pack) - count * items_per_pack

    # blocks: one per (group, node on the group's path); walk all paths up one level at a time
    block_group, block_node = [], []
    groups = np.arange(len(leaf), dtype=np.int64)
    node = leaf.copy()
    while len(node):
        block_group.append(groups)
        block_node.append(node)
        node = hp.node_parent[node]
        alive = node > 0
        node, groups = node[alive], groups[alive]
    bg = np.concatenate(block_group)
    bn = np.concatenate(block_node)
    # by size, then by group: each size's slots then run forward through the output, so the
    # items of a size (taken in id order) are written at increasing positions: cache friendly
    by_size = np.lexsort((bg, hp.node_size[bn]))
    bg, bn = bg[by_size], bn[by_size]

    reps = hp.node_reps[bn]
    packs = count[bg]
    need = packs * reps
    n = int(need.sum())
    dtype = np.int32 if n < 2**31 else np.int64
    stride = items_per_pack[bg]
    base = group_start[bg] + items_at[hp.node_parent[bn]]  # target of each block's first slot
    last = base + (packs - 1) * stride + reps - 1  # target of each block's last slot
    block_first = np.cumsum(need) - need

    step = np.zeros(n, dtype=dtype)
    step[block_first] = np.diff(stride, prepend=0)  # running sum: `stride` inside each block
    np.cumsum(step, out=step)
    # point corrections: the jump into each block, and back to the next pack-0 slot in a block
    step[block_first] += (base - np.concatenate(([0], last[:-1])) - stride).astype(dtype)
    runs = reps - 1
    if runs.sum():
        run_block = np.repeat(np.arange(len(bn)), runs)
        nth = np.arange(int(runs.sum())) - np.repeat(np.cumsum(runs) - runs, runs) + 1
        step[block_first[run_block] + nth * packs[run_block]] += (1 - packs * stride)[run_block].astype(dtype)
    block_size = hp.node_size[bn]  # ascending
    first_of_size = np.flatnonzero(np.diff(block_size, prepend=-1))
    slot_counts = np.add.reduceat(need, first_of_size) if len(bn) else np.zeros(0, dtype=np.int64)
    return np.cumsum(step, out=step), block_size[first_of_size], slot_counts


def size_ranks(sizes: np.ndarray, distinct: np.ndarray) -> np.ndarray:
    """(n,) rank of each of ``sizes`` in ``distinct`` (K,) (ascending): uint16 when K < 2**16.

    A lookup table while the largest size is small next to the number of items (one gather),
    else a binary search: memory follows the items, never the size values.
    Raises ``ValueError`` naming the first item whose size ``distinct`` lacks.

    >>> size_ranks(np.array([7, 3, 7, 10**12]), np.array([3, 7, 10**12])).tolist()
    [1, 0, 1, 2]
    """
    k = len(distinct)
    dtype = np.uint16 if k < 2**16 else np.int64
    if len(sizes) == 0:
        return np.zeros(0, dtype=dtype)
    largest = int(distinct[-1]) if k else 0
    low, high = int(sizes.min()), int(sizes.max())
    if k and low >= 0 and high <= largest and largest <= 4 * len(sizes) + (1 << 16):
        table = np.full(largest + 1, k, dtype=dtype)  # k marks a size the plan lacks
        table[distinct] = np.arange(k)
        ranks = table[sizes]
        missing = ranks == k
    else:
        ranks = np.searchsorted(distinct, sizes)
        missing = distinct[np.minimum(ranks, k - 1)] != sizes if k else np.ones(len(sizes), dtype=bool)
        ranks = ranks.astype(dtype)
    if missing.any():
        i = int(np.argmax(missing))
        raise ValueError(
            f"the sizes' histogram differs from the plan's: item {i} has size {int(sizes[i])}, "
            "which no slot of the plan has"
        )
    return ranks


def materialize(
    hp: HistogramPlan, sizes: np.ndarray, *, rng: np.random.Generator | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Packs of item ids: ``(indices, offsets)``, pack ``i`` is ``indices[offsets[i]:offsets[i+1]]``.

    Args:
        hp: the plan.
        sizes: (n,) int item sizes in the plan's units; their histogram must be the plan's.
        rng: None fills each size's slots with its items in id order; a generator shuffles
            which items of a size share packs (reproducibly).

    Returns:
        indices: (n,) int64 item ids, pack by pack, each pack in placement order.
        offsets: (num_packs+1,) int64, ``offsets[0] == 0``, ``offsets[-1] == n``.
    """
    targets, slot_sizes, slot_counts = slot_targets(hp)
    if len(sizes) != len(targets):
        raise ValueError(f"the plan holds {len(targets)} items but {len(sizes)} were given")
    if hp.capacity < SIZE_KEYS_BELOW:  # the size is the key (16-bit keys sort by radix)
        if len(sizes) and (sizes.min() < 1 or sizes.max() > hp.capacity):
            bad = (sizes < 1) | (sizes > hp.capacity)
            i = int(np.argmax(bad))
            raise ValueError(
                f"the sizes' histogram differs from the plan's: item {i} has size {int(sizes[i])}, "
                f"outside [1, capacity={hp.capacity}]"
            )
        keys = sizes.astype(np.uint16)
        key_slots = np.zeros(hp.capacity + 1, dtype=np.int64)
        key_slots[slot_sizes] = slot_counts
    else:  # the key is the size's rank among the plan's sizes: no array follows the capacity
        keys = size_ranks(sizes, slot_sizes)
        key_slots = slot_counts
    perm = None if rng is None else rng.permutation(len(sizes))
    indices = np.empty(len(sizes), dtype=np.int64)
    slots_upto = np.cumsum(key_slots)
    next_slot = slots_upto - key_slots  # first free slot of each key
    for start in range(0, len(sizes), CHUNK):
        ids = np.arange(start, min(start + CHUNK, len(sizes))) if perm is None else perm[start : start + CHUNK]
        chunk_keys = keys[ids]
        order = np.argsort(chunk_keys, kind="stable")
        sorted_keys = chunk_keys[order]
        chunk_counts = np.bincount(sorted_keys, minlength=len(key_slots))
        if (next_slot + chunk_counts > slots_upto).any():
            raise ValueError("the sizes' histogram differs from the plan's: some size has more items than slots")
        chosen = order + start if perm is None else ids[order]
        if len(ids) == len(sizes):  # one chunk: the sorted items are the slots, in order
            indices[targets] = chosen
        else:
            first_in_chunk = np.cumsum(chunk_counts) - chunk_counts
            slot = (next_slot - first_in_chunk)[sorted_keys] + np.arange(len(ids))
            indices[targets[slot]] = chosen
        next_slot += chunk_counts
    return indices, pack_offsets(hp)
