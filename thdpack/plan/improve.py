"""The improvement phase after the decreasing fit: re-pack the packs that are not full, each exactly.

Best-fit decreasing leaves a gap wherever no remaining sequence fits, which on templated SFT data
adds up to packs over the L2 bound. The phase pools the sequences of the packs that are not full
and packs them again one pattern at a time, each filled *exactly* when the pool allows (Gupta &
Ho's minimum bin slack, on the histogram): open with the largest size, fill greedily, close the
remainder by a one-for-two swap or a bounded subset sum. Each pattern repeats as often as the
counts allow, so the work follows the distinct patterns, not the sequences. An end game packs the
last ``END_GAME_PACKS`` packs again in proportion to the pool. The result is used only when it
has fewer packs: the phase never adds one. Full packs are left alone: re-packing them too cost
many times the fit's time on uniform lengths and did not save packs there.

>>> from thdpack.plan.decreasing_fit import fit_size_classes
>>> fit = fit_size_classes(np.array([3, 4]), np.array([4, 2]), 10)   # BFD: [4,4] [3,3,3] [3]
>>> hp = improve(fit, target=2)
>>> hp.num_packs, hp.fit_packs, hp.pack_contents(0), hp.group_count.tolist()   # 2 x [4,3,3]
(2, 3, [(4, 1), (3, 2)], [2])
"""

from __future__ import annotations

import bisect

import numpy as np

from thdpack.plan.bounds import l2_lower_bound_of_sizes
from thdpack.plan.histogram_plan import HistogramPlan

MAX_SUBSET_SUM_BITS = 1 << 16
"""Largest pack (slot units) for which the phase builds subset-sum bitsets and a dense count
array of the pool (2**16 slots: 64k tokens at cp_size 1, 512k at cp_size 4); larger packs are
filled greedily only, so nothing the phase allocates follows the pack size."""
END_GAME_PACKS = 128
"""The last packs of the re-packing that the end game packs again (at most this many subset
sums: its cost does not grow with the data)."""

Pattern = tuple[tuple[int, int], ...]
"""One pack's content: ``((size, reps), ...)``, sizes decreasing."""


def improve(hp: HistogramPlan, *, target: int) -> HistogramPlan:
    """A plan with fewer packs than ``hp`` when the phase finds one (its ``fit_packs`` says how
    many ``hp`` had), else ``hp`` itself.

    Args:
        hp: a plan (the fit of ``thdpack.plan.decreasing_fit``).
        target: a lower bound on the packs (``thdpack.plan.bounds``): the phase does nothing
            when ``hp`` already reaches it.
    """
    if hp.num_packs <= target:
        return hp
    capacity = hp.capacity
    full = hp.node_load()[hp.group_node] == capacity
    kept = int(hp.group_count[full].sum())
    pool = _pool_of(hp, ~full)
    if hp.num_packs - kept <= _l2(pool, capacity):  # no re-packing of the pool can need fewer
        return hp
    patterns = repack(pool, capacity)
    patterns = _end_game(patterns, capacity, goal=target - kept)
    if kept + sum(m for _, m in patterns) >= hp.num_packs:
        return hp
    return _with_patterns(hp, full, patterns)


def repack(pool: dict[int, int], capacity: int, *, balanced: bool = False) -> list[tuple[Pattern, int]]:
    """Pack the histogram ``pool`` (size -> count, sizes in ``[1, capacity]``) one exact-fill
    pattern at a time: ``[(pattern, packs), ...]`` in the order made (the module docstring).

    ``balanced``: the end game's variant: each pack is a subset sum over its whole room whose
    counts per size follow the pool's mix, made once (no repeats), so the mix left stays varied.

    >>> repack({6: 2, 4: 2, 3: 2, 2: 2}, 10)
    [(((6, 1), (4, 1)), 2), (((3, 2), (2, 2)), 1)]
    """
    left = SizePool(pool, capacity, shrinking=True)
    out: list[tuple[Pattern, int]] = []
    while left.present:
        used = left.balanced_fill() if balanced else left.fill()
        packs = 1 if balanced else min(left.avail[s] // k for s, k in used.items())
        left.take(used, packs)
        out.append((tuple(sorted(used.items(), reverse=True)), packs))
    return out


class SizePool:
    """Items by size not packed yet and the exact-fill rules that choose a pack from them: what
    the phase re-packs, and ``StreamingPacker``'s buffer (``thdpack.packing.streaming``).

    ``avail`` (size -> count), the sorted sizes ``present``, their ``volume``, and (packs up to
    ``MAX_SUBSET_SUM_BITS`` slots) a dense count array for pair searches. A fill's result does
    not depend on the order in which items were added (a resumed stream packs as the original).

    >>> pool = SizePool({5: 1, 4: 1, 3: 2}, capacity=10)
    >>> pool.fill(4)          # a pack that must hold a 4: greedy 4 + 5 leaves 1; 5 -> 3 + 3 closes it
    {4: 1, 3: 2}
    >>> pool.take({4: 1, 3: 2}); pool.add(5); pool.avail
    {5: 2}
    """

    def __init__(self, counts: dict[int, int], capacity: int, *, shrinking: bool = False) -> None:
        self.capacity = capacity
        self.shrinking = shrinking
        """True when items are only taken, never added (``repack``): then the sums the pool
        reaches only shrink, and ``_reachable`` (computed once, refreshed after a miss) rules out
        targets no fill can reach without a subset sum or a pair search each time."""
        self._reachable: int | None = None
        self._taken_since = 0  # takes since ``_reachable`` was computed
        self.avail = {s: c for s, c in counts.items() if c}
        self.present = sorted(self.avail)
        self.volume = sum(s * c for s, c in self.avail.items())
        self.dense = None
        if capacity <= MAX_SUBSET_SUM_BITS:
            self.dense = np.zeros(capacity + 1, dtype=np.int64)
            self.dense[self.present] = [self.avail[s] for s in self.present]

    def add(self, size: int, count: int = 1) -> None:
        """Put ``count`` items of ``size`` (in ``[1, capacity]``) into the pool."""
        if self.shrinking:
            raise ValueError("items cannot be added to a shrinking pool")
        if size not in self.avail:
            bisect.insort(self.present, size)
        self.avail[size] = self.avail.get(size, 0) + count
        if self.dense is not None:
            self.dense[size] += count
        self.volume += size * count

    def take(self, used: dict[int, int], packs: int = 1) -> None:
        """Remove ``packs`` copies of the pack ``used`` from the pool."""
        self._taken_since += 1
        for s, k in used.items():
            left = self.avail[s] - k * packs
            if left:
                self.avail[s] = left
            else:
                del self.avail[s]
                del self.present[bisect.bisect_left(self.present, s)]
            if self.dense is not None:
                self.dense[s] = left
            self.volume -= s * k * packs

    def fill(self, first: int | None = None, *, close: bool = True) -> dict[int, int]:
        """One pack (size -> count, not yet taken from the pool): ``first`` (default: the largest
        size left; it must be in the pool), then its room filled greedily, then (``close``)
        closed by a pair swap or a subset sum (module docstring, steps 1-4)."""
        first = self.present[-1] if first is None else first
        used = {first: 1}
        room = self._greedy(used, self.capacity - first)
        if room and close and not self._pair_swap(used, room, first):
            used = self._subset_sum_fill(used, room, first)
        return used

    def _greedy(self, used: dict[int, int], room: int) -> int:
        """Add the largest sizes that fit to ``used`` (as many copies as fit at once); the room left."""
        present, avail = self.present, self.avail
        i = bisect.bisect_right(present, room) - 1
        while room and i >= 0:
            s = present[i]
            spare = avail[s] - used.get(s, 0)
            if spare:
                take = min(spare, room // s)
                used[s] = used.get(s, 0) + take
                room -= take * s
            i = bisect.bisect_right(present, room, 0, i) - 1
        return room

    def _pair_swap(self, used: dict[int, int], room: int, first: int) -> bool:
        """Close ``room`` by exchanging one chosen item of size ``s`` (not the opening one) for two,
        ``a + b = s + room`` (the largest ``a`` that has a partner; vectorised over the dense counts)."""
        dense = self.dense
        if dense is None:
            return False
        chosen = list(used.items())
        for s, k in chosen:
            dense[s] -= k
        try:
            for s, k in sorted(chosen, reverse=True):
                if s == first and k == 1:
                    continue
                total = s + room
                high = min(total - 1, self.capacity)
                low = (total + 1) // 2
                if low > high or not self._may_reach(total):
                    continue
                dense[s] += 1
                a = np.arange(high, low - 1, -1)
                ok = (dense[a] > 0) & (dense[total - a] > (a == total - a))
                dense[s] -= 1
                if ok.any():
                    a = int(a[np.argmax(ok)])
                    _move(used, s, -1)
                    _move(used, a, 1)
                    _move(used, total - a, 1)
                    return True
            return False
        finally:
            for s, k in chosen:
                dense[s] += k

    def _subset_sum_fill(self, used: dict[int, int], room: int, first: int) -> dict[int, int]:
        """Re-choose the pack's smallest items by subset sum over the pool, widening the re-chosen
        part (up to a room of 64 or 4x the gap, then 8x more each time, then everything but
        ``first``) until the pack is exact; the fullest pack found."""
        best, best_room = used, room
        movable = sorted((s, k - (s == first)) for s, k in used.items())
        movable = [(s, k) for s, k in movable if k]
        keep = dict(used)
        target, tried, limit = room, room, max(4 * room, 64)  # nothing in the pool fits `room` alone
        while True:
            while movable and (limit >= self.capacity or target + movable[0][0] * movable[0][1] <= limit):
                s, k = movable.pop(0)
                _move(keep, s, -k)
                target += s * k
            if target != tried and self._may_reach(target):
                if self.dense is None:
                    return best
                tried = target
                fill = self._subset_sum(keep, target, share=None)
                fill_room = target - sum(s * k for s, k in fill.items())
                if fill_room < best_room:
                    best = dict(keep)
                    for s, k in fill.items():
                        _move(best, s, k)
                    best_room = fill_room
                    if not best_room:
                        return best
                self._missed()
            if not movable:
                return best
            limit *= 8

    def _may_reach(self, total: int) -> bool:
        """False only when no choice of the pool's items sums to ``total`` (shrinking pools)."""
        if not self.shrinking or self.dense is None:
            return True
        if self._reachable is None:
            self._reachable = self._reach_all()
            self._taken_since = 0
        return bool(self._reachable >> total & 1)

    def _missed(self) -> None:
        """A target ``_may_reach`` let through was missed: recompute the reachable sums if the
        pool changed since (else the miss came from the pack's own items and says nothing)."""
        if self.shrinking and self._taken_since:
            self._reachable = None

    def _reach_all(self) -> int:
        """Bitset of the sums <= capacity that some choice of the pool's items reaches."""
        mask = (1 << (self.capacity + 1)) - 1
        reach = 1
        for s in self.present:
            limit, step = min(self.avail[s], self.capacity // s), 1
            while limit:
                k = min(step, limit)
                reach |= (reach << (k * s)) & mask
                limit -= k
                step *= 2
        return reach

    def balanced_fill(self) -> dict[int, int]:
        """One pack: the largest size left and a subset sum over the rest of the room whose count
        of each size is the nearest feasible to the size's share of the pool (the end game)."""
        first = self.present[-1]
        used = {first: 1}
        room = self.capacity - first
        if self.dense is None:
            self._greedy(used, room)
            return used
        share = self.capacity / self.volume if self.volume else 0.0
        for s, k in self._subset_sum(used, room, share=share).items():
            _move(used, s, k)
        return used

    def _subset_sum(self, taken: dict[int, int], target: int, *, share: float | None) -> dict[int, int]:
        """Items of the pool (less ``taken``) with the largest sum <= ``target``: bounded subset sum
        on a bitset (bit ``v`` set: some choice sums to ``v``), one size class at a time.

        Among the choices of that sum it takes, size by size from the largest, the most copies
        (``share=None``) or the count nearest ``share`` x the size's count in the pool."""
        counts = self.dense[1 : target + 1].copy()  # the pool less ``taken``, sizes 1..target
        for s, k in taken.items():
            if s <= target:
                counts[s - 1] -= k
        sizes_at = np.flatnonzero(counts > 0)
        sizes = (sizes_at + 1).tolist()
        limits = np.minimum(counts[sizes_at], target // (sizes_at + 1)).tolist()
        mask = (1 << (target + 1)) - 1
        reach = 1
        before = []
        for s, limit in zip(sizes, limits, strict=True):
            before.append(reach)
            step = 1
            while limit:  # binary splitting: copies 1, 2, 4, ... reach every count up to the limit
                k = min(step, limit)
                reach |= (reach << (k * s)) & mask
                limit -= k
                step *= 2
        total = target if reach >> target & 1 else reach.bit_length() - 1
        fill: dict[int, int] = {}
        for s, limit, prior in zip(reversed(sizes), reversed(limits), reversed(before), strict=True):
            top = min(limit, total // s)
            if share is None:
                k = top
                while not prior >> (total - k * s) & 1:
                    k -= 1
            else:
                k = _nearest_feasible(prior, total, s, top, round(share * self.avail[s]))
            if k:
                fill[s] = k
                total -= k * s
        return fill


def _nearest_feasible(prior: int, total: int, s: int, top: int, want: int) -> int:
    """The count ``k`` in ``[0, top]`` nearest ``want`` whose remainder ``total - k*s`` the
    smaller sizes reach (bit set in ``prior``); ties go to the larger count."""
    want = min(max(want, 0), top)
    for d in range(top + 1):
        for k in (want + d, want - d):
            if 0 <= k <= top and prior >> (total - k * s) & 1:
                return k
    raise AssertionError("the subset sum reached `total`, so some count is feasible")


def _move(counts: dict[int, int], size: int, k: int) -> None:
    """``counts[size] += k``, dropping sizes that reach 0."""
    left = counts.get(size, 0) + k
    if left:
        counts[size] = left
    else:
        del counts[size]


def _end_game(patterns: list[tuple[Pattern, int]], capacity: int, *, goal: int) -> list[tuple[Pattern, int]]:
    """Pack the last ``END_GAME_PACKS`` packs once more with balanced fills (a pattern repeated
    across the boundary is split); keep whichever of the two has fewer packs."""
    if sum(m for _, m in patterns) <= max(goal, 0):
        return patterns
    start, reopened = len(patterns), 0
    while start and reopened < END_GAME_PACKS:
        start -= 1
        reopened += patterns[start][1]
    head = patterns[:start]
    tail = patterns[start:]
    if reopened > END_GAME_PACKS:  # the boundary pattern: keep its first copies, re-open the rest
        pattern, m = tail[0]
        head = [*head, (pattern, reopened - END_GAME_PACKS)]
        tail = [(pattern, m - (reopened - END_GAME_PACKS)), *tail[1:]]
    pool: dict[int, int] = {}
    for pattern, m in tail:
        for s, k in pattern:
            pool[s] = pool.get(s, 0) + k * m
    if sum(m for _, m in tail) <= _l2(pool, capacity):  # the last packs are as few as can be
        return patterns
    again = repack(pool, capacity, balanced=True)
    if sum(m for _, m in again) < sum(m for _, m in tail):
        return head + again
    return patterns


def _l2(pool: dict[int, int], capacity: int) -> int:
    """The L2 bound of a pool (size -> count)."""
    sizes = np.fromiter(pool, dtype=np.int64, count=len(pool))
    counts = np.fromiter(pool.values(), dtype=np.int64, count=len(pool))
    return l2_lower_bound_of_sizes(sizes, counts, capacity)


def _pool_of(hp: HistogramPlan, groups: np.ndarray) -> dict[int, int]:
    """size -> items in the packs of the selected groups."""
    pool: dict[int, int] = {}
    for g in np.flatnonzero(groups).tolist():
        packs = int(hp.group_count[g])
        node = int(hp.group_node[g])
        while node > 0:
            s = int(hp.node_size[node])
            pool[s] = pool.get(s, 0) + int(hp.node_reps[node]) * packs
            node = int(hp.node_parent[node])
    return pool


def _with_patterns(hp: HistogramPlan, keep: np.ndarray, patterns: list[tuple[Pattern, int]]) -> HistogramPlan:
    """``hp``'s groups selected by ``keep`` plus one group per pattern (a chain of new nodes),
    all groups ordered by their largest item, decreasing (packs of big sequences first)."""
    parent, size, reps = hp.node_parent.tolist(), hp.node_size.tolist(), hp.node_reps.tolist()
    new_node, new_count = [], []
    for pattern, m in patterns:
        node = 0
        for s, k in pattern:
            parent.append(node)
            size.append(s)
            reps.append(k)
            node = len(size) - 1
        new_node.append(node)
        new_count.append(m)
    group_node = np.concatenate((hp.group_node[keep], np.asarray(new_node, dtype=np.int64)))
    group_count = np.concatenate((hp.group_count[keep], np.asarray(new_count, dtype=np.int64)))
    node_parent = np.asarray(parent, dtype=np.int64)
    node_size = np.asarray(size, dtype=np.int64)
    order = np.argsort(-_largest_item(node_parent, node_size, group_node), kind="stable")
    return HistogramPlan(
        capacity=hp.capacity,
        node_parent=node_parent,
        node_size=node_size,
        node_reps=np.asarray(reps, dtype=np.int64),
        group_node=group_node[order],
        group_count=group_count[order],
        fit_packs=hp.num_packs,
    )


def _largest_item(parent: np.ndarray, size: np.ndarray, leaf: np.ndarray) -> np.ndarray:
    """(G,) size of each group's first node (its largest item: packs are built largest first)."""
    node = leaf.copy()
    up = parent[node]
    while (up > 0).any():
        node = np.where(up > 0, up, node)
        up = parent[node]
    return size[node]
