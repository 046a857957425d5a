"""The bfd / ffd engine of ``plan_packs`` as it was before it worked on distinct sizes (issue 9,
item 8): every array indexed by size, ``capacity + 1`` long. Frozen verbatim (only renamed) as
the oracle that the capacity-free engine must reproduce exactly; usable on small capacities only.
"""

from __future__ import annotations

import bisect

import numpy as np

from thdpack.plan.assignment import CHUNK, pack_offsets
from thdpack.plan.histogram import HistogramPlan, _finish, _Runs


def dense_plan_packs_engine(
    units: np.ndarray, capacity: int, fit: str, rng: np.random.Generator | None
) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, offsets)`` that the old ``plan_packs`` computed for bfd / ffd from slot ``units``."""
    engine_capacity = min(capacity, int(units.sum()))
    counts = np.bincount(units, minlength=engine_capacity + 1)
    hp = _best_fit(counts, engine_capacity, rng) if fit == "bfd" else _first_fit(counts, engine_capacity)
    return materialize(hp, units, rng=rng)


def _best_fit(counts: np.ndarray, capacity: int, rng: np.random.Generator | None) -> HistogramPlan:
    nodes: list[tuple[int, int, int]] = [(-1, 0, 0)]  # (parent, size, reps); node 0 = empty pack
    rooms: list[int] = []  # sorted rooms that have at least one group
    buckets: dict[int, list[list[int]]] = {}  # room -> [[node, packs], ...]

    def grow(room: int, parent: int, size: int, reps: int, packs: int) -> None:
        """``packs`` packs with content ``parent`` + ``reps`` x ``size`` now have ``room`` left."""
        nodes.append((parent, size, reps))
        bucket = buckets.get(room)
        if bucket is None:
            buckets[room] = bucket = []
            bisect.insort(rooms, room)
        bucket.append([len(nodes) - 1, packs])

    sizes = np.flatnonzero(counts)[::-1]
    # Items over half a pack never share a pack and no room fits them: one pack each, in bulk.
    big = sizes[sizes > capacity // 2].tolist()
    for size in big:  # decreasing sizes give increasing rooms: `rooms` stays sorted
        nodes.append((0, size, 1))
        rooms.append(capacity - size)
        buckets[capacity - size] = [[len(nodes) - 1, int(counts[size])]]
    for size in sizes[len(big) :].tolist():
        left = int(counts[size])
        while left:
            i = bisect.bisect_left(rooms, size)
            if i == len(rooms):  # nothing fits: open packs holding as many copies as fit
                per_pack = capacity // size
                full, rest = divmod(left, per_pack)
                if full:
                    grow(capacity - per_pack * size, 0, size, per_pack, full)
                if rest:
                    grow(capacity - rest * size, 0, size, rest, 1)
                break
            room = rooms[i]
            per_pack = room // size
            bucket = buckets[room]
            while bucket and left:
                j = len(bucket) - 1 if rng is None or len(bucket) == 1 else int(rng.integers(len(bucket)))
                node, packs = bucket[j]
                if left >= packs * per_pack:
                    bucket[j] = bucket[-1]
                    bucket.pop()
                    left -= packs * per_pack
                    grow(room - per_pack * size, node, size, per_pack, packs)
                    continue
                full, rest = divmod(left, per_pack)
                left = 0
                untouched = packs - full - (1 if rest else 0)
                if untouched:
                    bucket[j][1] = untouched
                else:
                    bucket[j] = bucket[-1]
                    bucket.pop()
                if full:
                    grow(room - per_pack * size, node, size, per_pack, full)
                if rest:
                    grow(room - rest * size, node, size, rest, 1)
            if not bucket:
                del buckets[room]
                del rooms[bisect.bisect_left(rooms, room)]

    group_node = np.asarray([g[0] for room in rooms for g in buckets[room]], dtype=np.int64)
    group_count = np.asarray([g[1] for room in rooms for g in buckets[room]], dtype=np.int64)
    # creation order of the content nodes: packs holding the largest items come first
    return _finish(capacity, nodes, group_node, group_count, np.argsort(group_node, kind="stable"))


def _first_fit(counts: np.ndarray, capacity: int) -> HistogramPlan:
    nodes: list[tuple[int, int, int]] = [(-1, 0, 0)]  # (parent, size, reps); node 0 = empty pack

    def node(parent: int, size: int, reps: int) -> int:
        nodes.append((parent, size, reps))
        return len(nodes) - 1

    runs = _Runs()
    opened = 0  # packs opened so far; also the next pack's index
    never = np.iinfo(np.int64).max
    for size in np.flatnonzero(counts)[::-1].tolist():
        left = int(counts[size])
        while left:
            n = runs.n
            fits = runs.room[:n] >= size
            if not fits.any():
                per_pack = capacity // size
                full, rest = divmod(left, per_pack)
                if full:
                    runs.append(opened, full, capacity - per_pack * size, node(0, size, per_pack))
                    opened += full
                if rest:
                    runs.append(opened, 1, capacity - rest * size, node(0, size, rest))
                    opened += 1
                break
            k = int(np.argmin(np.where(fits, runs.first[:n], never)))
            room, packs, content, first = (
                int(runs.room[k]),
                int(runs.packs[k]),
                int(runs.node[k]),
                int(runs.first[k]),
            )
            per_pack = room // size
            if left >= packs * per_pack:
                left -= packs * per_pack
                runs.room[k] = room - per_pack * size
                runs.node[k] = node(content, size, per_pack)
                continue
            full, rest = divmod(left, per_pack)
            left = 0
            # the run splits into [full packs][one partial pack][untouched packs], in pack order
            tail_first, tail_packs = first + full, packs - full
            if full:
                runs.packs[k] = full
                runs.room[k] = room - per_pack * size
                runs.node[k] = node(content, size, per_pack)
            if rest:
                partial = node(content, size, rest)
                if full:
                    runs.append(tail_first, 1, room - rest * size, partial)
                else:
                    runs.packs[k], runs.room[k], runs.node[k] = 1, room - rest * size, partial
                tail_first, tail_packs = tail_first + 1, tail_packs - 1
            if tail_packs:
                runs.append(tail_first, tail_packs, room, content)
    n = runs.n
    # FFD's natural order: by opening time
    return _finish(capacity, nodes, runs.node[:n], runs.packs[:n], np.argsort(runs.first[:n], kind="stable"))


def slot_targets(hp: HistogramPlan) -> tuple[np.ndarray, np.ndarray]:
    """``(targets, slot_counts)``: (n,) flat output position of every slot, slots ordered by size
    (ascending), and (capacity+1,) int64 slots of each size.

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
    slot_counts = np.bincount(hp.node_size[bn], weights=need, minlength=hp.capacity + 1).astype(np.int64)
    return np.cumsum(step, out=step), slot_counts


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
    capacity = hp.capacity
    targets, slot_counts = slot_targets(hp)
    if len(sizes) != len(targets):
        raise ValueError(f"the plan holds {len(targets)} items but {len(sizes)} were given")
    keys = sizes.astype(np.uint16) if capacity < 2**16 else sizes  # 16-bit keys sort by radix
    perm = None if rng is None else rng.permutation(len(sizes))
    indices = np.empty(len(sizes), dtype=np.int64)
    next_slot = np.cumsum(slot_counts) - slot_counts  # first free slot of each size
    for start in range(0, len(sizes), CHUNK):
        ids = np.arange(start, min(start + CHUNK, len(sizes))) if perm is None else perm[start : start + CHUNK]
        chunk_keys = keys[ids]
        order = np.argsort(chunk_keys, kind="stable")
        sorted_keys = chunk_keys[order]
        chunk_counts = np.bincount(sorted_keys, minlength=capacity + 1)
        if len(chunk_counts) > capacity + 1 or (next_slot + chunk_counts > np.cumsum(slot_counts)).any():
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
