"""Turn a histogram plan (templates x counts) into concrete packs of sequence indices.

Every item of size ``s`` is interchangeable with every other item of size ``s``, so the
assignment is a single O(n) vectorised scatter: the items, sorted by size, are cut into
consecutive *blocks* (one block per (group, template node) pair), and each block's items are
written to their places in the packs of its group.

>>> from thdpack.plan.histogram import plan_histogram
>>> sizes = np.array([3, 5, 1, 3, 4, 5])
>>> hp = plan_histogram(np.bincount(sizes, minlength=11), capacity=10)
>>> order = np.argsort(sizes, kind="stable")
>>> indices, offsets = materialize(hp, order)
>>> [sizes[indices[a:b]].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
[[5, 5], [4, 3, 3], [1]]
>>> [indices[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
[[1, 5], [4, 0, 3], [2]]
"""

from __future__ import annotations

import numpy as np

from thdpack.plan.histogram import HistogramPlan, path_sums


def materialize(hp: HistogramPlan, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Packs of item ids: ``(indices, offsets)``, pack ``i`` is ``indices[offsets[i]:offsets[i+1]]``.

    Args:
        hp: the plan; item sizes in its slot units.
        order: (n,) int item ids sorted by size, ascending (ties in any order: the order within
            a size decides which items share a pack). ``n`` must equal the plan's item count.

    Returns:
        indices: (n,) int64 item ids, pack by pack, each pack in placement order.
        offsets: (num_packs+1,) int64, ``offsets[0] == 0``, ``offsets[-1] == n``.
    """
    items_at = path_sums(hp.node_parent, hp.node_reps)  # items in a pack ending at each node
    leaf, count = hp.group_node, hp.group_count
    items_per_pack = items_at[leaf]
    group_items = count * items_per_pack
    group_start = np.cumsum(group_items) - group_items  # first entry of each group's first pack

    offsets = np.empty(int(count.sum()) + 1, dtype=np.int64)
    offsets[0] = 0
    np.cumsum(np.repeat(items_per_pack, count), out=offsets[1:])

    # blocks: one per (group, node on the group's path); walk all paths up one level at a time
    block_group, block_node = [], []
    group_ids = np.arange(len(leaf), dtype=np.int64)
    node = leaf.copy()
    while len(node):
        block_group.append(group_ids)
        block_node.append(node)
        node = hp.node_parent[node]
        alive = node > 0
        node, group_ids = node[alive], group_ids[alive]
    bg = np.concatenate(block_group) if block_group else np.zeros(0, dtype=np.int64)
    bn = np.concatenate(block_node) if block_node else np.zeros(0, dtype=np.int64)
    by_size = np.argsort(hp.node_size[bn], kind="stable")  # the same size order as `order`
    bg, bn = bg[by_size], bn[by_size]

    reps = hp.node_reps[bn]
    packs = count[bg]
    need = packs * reps
    n = int(need.sum())
    if n != len(order):
        raise ValueError(f"the plan holds {n} items but {len(order)} were given")
    # Inside a block, item k goes to pack k // reps of the group, slot k % reps after the
    # block's position in the pack. Targets are built as a cumulative sum of steps (+1 inside a
    # pack, +stride - reps + 1 to the next pack), which is cheaper than per-item arithmetic.
    stride = items_per_pack[bg]
    base = group_start[bg] + items_at[hp.node_parent[bn]]  # target of the block's first item
    block_first = np.cumsum(need) - need
    step = np.repeat(np.where(reps == 1, stride, 1), need)
    multi = (reps > 1) & (packs > 1)
    wraps = packs[multi] - 1  # pack changes inside each multi-item block
    if wraps.sum():
        wrap_block = np.repeat(np.flatnonzero(multi), wraps)
        nth = np.arange(int(wraps.sum()), dtype=np.int64) - np.repeat(np.cumsum(wraps) - wraps, wraps) + 1
        step[block_first[wrap_block] + nth * reps[wrap_block]] = (stride - reps + 1)[wrap_block]
    last = base + (packs - 1) * stride + reps - 1  # target of each block's last item
    nonempty = need > 0
    starts = block_first[nonempty]
    step[starts] = base[nonempty] - np.concatenate(([0], last[nonempty][:-1]))
    indices = np.empty(n, dtype=np.int64)
    indices[np.cumsum(step)] = order
    return indices, offsets
