"""Decreasing-order bin packing on a length histogram: packs as templates x counts.

Sequences of equal slot size are interchangeable, so best-fit / first-fit decreasing run per size
class: all ``c`` items of size ``s`` go, in one step each, to whole *groups* of identical open
packs, and the cost follows the distinct sizes and groups (thousands), not the sequences
(millions or billions). A group step equals ``c`` item steps: for decreasing sizes, once BFD
puts an item of size ``s`` into a pack with room ``r``, the room left is again the smallest that
fits one while it does, so BFD fills that pack with ``floor(r / s)`` copies before moving on (FFD
likewise). A pack's content is a path in a tree of nodes: node ``t`` adds ``node_reps[t]`` items
of size ``node_size[t]`` to the content of ``node_parent[t]`` (node 0 is the empty pack).

>>> hp = fit_size_classes(*distinct_sizes(np.array([5, 5, 4, 3, 3, 1])), capacity=10, fit="bfd")
>>> hp.num_packs
3
>>> sorted(hp.pack_contents(g) for g in range(len(hp.group_node)))
[[(1, 1)], [(4, 1), (3, 2)], [(5, 2)]]
"""

from __future__ import annotations

import bisect
from typing import Literal

import numpy as np

from thdpack.plan.histogram_plan import HistogramPlan

Fit = Literal["bfd", "ffd"]
FITS: tuple[str, ...] = ("bfd", "ffd")


def _finish(
    capacity: int, nodes: list[tuple[int, int, int]], group_node: np.ndarray, group_count: np.ndarray, order: np.ndarray
) -> HistogramPlan:
    """The plan from the planning loop's node tuples ``(parent, size, reps)`` and its groups,
    the groups listed in ``order``."""
    table = np.asarray(nodes, dtype=np.int64).reshape(-1, 3)
    return HistogramPlan(
        capacity=capacity,
        node_parent=table[:, 0].copy(),
        node_size=table[:, 1].copy(),
        node_reps=table[:, 2].copy(),
        group_node=np.asarray(group_node, dtype=np.int64)[order],
        group_count=np.asarray(group_count, dtype=np.int64)[order],
    )


def fit_size_classes(
    sizes: np.ndarray,
    counts: np.ndarray,
    capacity: int,
    *,
    fit: Fit = "bfd",
    rng: np.random.Generator | None = None,
) -> HistogramPlan:
    """The decreasing fit of ``counts[i]`` items of size ``sizes[i]`` into packs of ``capacity``:
    the same packs as item-level BFD / FFD, in time and memory that follow the number of distinct
    sizes and of pack groups, whatever ``capacity`` is.

    Args:
        sizes: (K,) integers, strictly increasing, in ``[1, capacity]`` (slot units).
        counts: (K,) integers >= 1: items of each size.
        capacity: pack capacity in slot units (>= 1).
        fit: ``"bfd"`` (best fit: the fullest pack that still fits) or ``"ffd"`` (first fit:
            the oldest pack that fits). Sizes are visited in decreasing order.
        rng: when given, BFD breaks ties between equally full packs of different content at
            random (reproducibly), which reshuffles pairings.

    >>> hp = fit_size_classes(np.array([1, 3, 4, 5]), np.array([1, 2, 1, 2]), capacity=10**12)
    >>> hp.num_packs, hp.pack_contents(0)
    (1, [(5, 2), (4, 1), (3, 2), (1, 1)])
    """
    sizes = np.asarray(sizes)
    counts = np.asarray(counts)
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if sizes.ndim != 1 or sizes.shape != counts.shape:
        raise ValueError(f"sizes and counts must be 1-D of one length, got shapes {sizes.shape} and {counts.shape}")
    if len(sizes) and (sizes[0] < 1 or sizes[-1] > capacity or (np.diff(sizes) <= 0).any()):
        raise ValueError(
            f"sizes must be strictly increasing integers in [1, capacity={capacity}], got "
            f"{sizes[:5].tolist()}{' ...' if len(sizes) > 5 else ''} (smallest {sizes.min()}, largest {sizes.max()})"
        )
    if (counts < 1).any():
        raise ValueError(f"counts must be >= 1 (list only the sizes that occur), got {int(counts.min())}")
    # decreasing sizes, as plain ints: the loops below are per size class and per group
    classes = list(zip(sizes[::-1].tolist(), counts[::-1].tolist(), strict=True))
    if fit == "bfd":
        return _best_fit(classes, capacity, rng)
    if fit == "ffd":
        return _first_fit(classes, capacity)
    raise ValueError(f"unknown fit {fit!r}; valid: {', '.join(FITS)}")


def _best_fit(classes: list[tuple[int, int]], capacity: int, rng: np.random.Generator | None) -> HistogramPlan:
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

    # Items over half a pack never share a pack and no room fits them: one pack each, in bulk.
    big = next((i for i, (size, _) in enumerate(classes) if size <= capacity // 2), len(classes))
    for size, count in classes[:big]:  # decreasing sizes give increasing rooms: `rooms` stays sorted
        nodes.append((0, size, 1))
        rooms.append(capacity - size)
        buckets[capacity - size] = [[len(nodes) - 1, count]]
    for size, left in classes[big:]:
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


class _Runs:
    """Runs of consecutive packs (by opening order) with equal content: FFD's state.

    Stored in numpy arrays so "the first run that fits" is one vectorised scan.
    """

    def __init__(self) -> None:
        self.n = 0
        self.first = np.zeros(64, dtype=np.int64)  # index of the run's first pack
        self.packs = np.zeros(64, dtype=np.int64)
        self.room = np.full(64, -1, dtype=np.int64)
        self.node = np.zeros(64, dtype=np.int64)

    def append(self, first: int, packs: int, room: int, node: int) -> None:
        if self.n == len(self.first):
            for name in ("first", "packs", "room", "node"):
                arr = getattr(self, name)
                grown = np.full(2 * len(arr), -1 if name == "room" else 0, dtype=np.int64)
                grown[: len(arr)] = arr
                setattr(self, name, grown)
        k = self.n
        self.first[k], self.packs[k], self.room[k], self.node[k] = first, packs, room, node
        self.n += 1


def _first_fit(classes: list[tuple[int, int]], capacity: int) -> HistogramPlan:
    nodes: list[tuple[int, int, int]] = [(-1, 0, 0)]  # (parent, size, reps); node 0 = empty pack

    def node(parent: int, size: int, reps: int) -> int:
        nodes.append((parent, size, reps))
        return len(nodes) - 1

    runs = _Runs()
    opened = 0  # packs opened so far; also the next pack's index
    never = np.iinfo(np.int64).max
    for size, left in classes:
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


def distinct_sizes(units: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct sizes, their counts): a histogram while the largest size is small next to the
    number of items (O(n), the common case), else a sort (no array sized by the largest value)."""
    largest = int(units.max())
    if largest <= 4 * len(units) + (1 << 16):
        counts = np.bincount(units)
        sizes = np.flatnonzero(counts)
        return sizes, counts[sizes]
    return np.unique(units, return_counts=True)
