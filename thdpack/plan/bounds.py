"""Lower bounds on the number of packs: the Martello–Toth L2 bound and two stronger ones.

L2 (Martello & Toth, 1990) improves the sum bound ``ceil(sum / C)`` with the fact that two items
over half a pack never share one: for a threshold ``a <= C/2``, items over ``C - a`` (J1) and in
``(C/2, C - a]`` (J2) each need their own pack, and items in ``[a, C/2]`` (J3) fill J2's room
first::

    L(a) = |J1| + |J2| + max(0, ceil((sum(J3) - (|J2| C - sum(J2))) / C)),   L2 = max_a L(a)

L2 treats J3 as fluid. ``best_lower_bound_of_sizes`` also takes *single fills* (a J2 pack with
room below ``2a`` holds at most one J3 item: a matching bounds what J3 can put there) and the dual
feasible function of Carlier, Clautiaux & Moukrim (2007), each evaluated at the few thresholds
where L(a) peaks: O(k) in the distinct sizes.

>>> l2_lower_bound(np.bincount([6, 6, 6, 4, 4, 4], minlength=11), capacity=10)
3
>>> l2_lower_bound(np.bincount([6, 6, 6, 5, 5], minlength=11), capacity=10)   # sum bound says 3
4

The two integral bounds, of which ``best_lower_bound_of_sizes`` reports the largest with L2:

- **single fills** (an integral refinement of L(a)): a pack of J2 whose room is below ``2a`` holds
  at most ONE item of J3, so J3 can put at most ``M(a)`` there, the largest volume of a matching
  of J3's items to those rooms (each item into a room at least its size), plus the rooms of
  ``2a`` or more in full; the rest needs new packs.
- **the dual feasible function of Carlier, Clautiaux & Moukrim (2007)**: sizes rounded down to
  multiples of ``lam`` (``2*floor(s/lam)`` below C/2, ``2*(floor(C/lam) - floor((C-s)/lam))``
  above, ``floor(C/lam)`` at C/2) sum to at most ``2*floor(C/lam)`` per pack, so their total over
  that is a bound for every ``lam`` in ``[1, C/2]``.

>>> sizes, counts = np.array([3, 7]), np.array([3, 2])   # two 7s, whose rooms of 5 take one 3 each
>>> l2_lower_bound_of_sizes(sizes, counts, 12), best_lower_bound_of_sizes(sizes, counts, 12)
(2, 3)
"""

from __future__ import annotations

import numpy as np


def l2_lower_bound(counts: np.ndarray, capacity: int) -> int:
    """Martello–Toth L2 for ``counts[s]`` items of size ``s`` in packs of ``capacity``.

    Args:
        counts: (capacity+1,) non-negative integers, item sizes in ``[1, capacity]``.
        capacity: pack capacity (same units as the sizes).

    Returns:
        The bound: no packing of these items needs fewer packs.
    """
    counts = np.asarray(counts, dtype=np.int64)
    sizes = np.flatnonzero(counts)
    return l2_lower_bound_of_sizes(sizes, counts[sizes], capacity)


def l2_lower_bound_of_sizes(sizes: np.ndarray, counts: np.ndarray, capacity: int) -> int:
    """L2 from the DISTINCT item sizes and how many items have each: memory and time O(k log k)
    for k distinct sizes, whatever the capacity.

    ``L(a)`` only changes where an item size enters J3 (``a = s`` for ``s <= C/2``) or leaves J2
    for J1 (``a = C - s + 1`` for ``s > C/2``), so its maximum is taken at ``a = 0`` or at one of
    those thresholds.

    >>> l2_lower_bound_of_sizes(np.array([5, 6]), np.array([2, 3]), capacity=10)
    4
    """
    return int(_l2_by_threshold(*_sorted(sizes, counts), capacity)[1].max())


def best_lower_bound_of_sizes(sizes: np.ndarray, counts: np.ndarray, capacity: int, *, peaks: int = 8) -> int:
    """The largest of L2, the single-fill bound and the CCM bound (module docstring), the last
    two at the ``peaks`` thresholds where L(a) is largest (the largest ``a`` among ties) and
    ``lam`` within 8 of the best four; never above the optimum.

    >>> best_lower_bound_of_sizes(np.array([3, 7]), np.array([3, 2]), capacity=12)   # L2 says 2
    3
    """
    sizes, counts = _sorted(sizes, counts)
    thresholds, l2 = _l2_by_threshold(sizes, counts, capacity)
    best = int(l2.max())
    top = thresholds[np.lexsort((-thresholds, -l2))[:peaks]]
    top = top[top > 0]
    if not len(top):
        return best
    single = _SingleFills(sizes, counts, capacity)
    best = max(best, *(single.bound(a) for a in top.tolist()))
    lams = np.unique(np.clip((top[:4, None] + np.arange(-8, 9)).ravel(), 1, capacity // 2))
    return max(best, _ccm_bound(sizes, counts, capacity, lams))


def _sorted(sizes: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(sizes)
    return np.asarray(sizes, dtype=np.int64)[order], np.asarray(counts, dtype=np.int64)[order]


def _l2_by_threshold(sizes: np.ndarray, counts: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """(thresholds a, L(a) at each): every threshold where L(a) can change, ascending."""
    half = capacity // 2
    count_le = np.concatenate(([0], np.cumsum(counts)))  # index j: items among the j smallest sizes
    sum_le = np.concatenate(([0], np.cumsum(counts * sizes)))

    def below(x: np.ndarray) -> np.ndarray:
        """How many distinct sizes are <= x."""
        return np.searchsorted(sizes, x, side="right")

    a = np.sort(np.concatenate(([0], sizes[sizes <= half], capacity - sizes[sizes > half] + 1)))
    a = a[np.diff(a, prepend=-1) > 0]  # distinct (np.unique without counts hashes: 20x slower on 1M)
    a = a[(a >= 0) & (a <= half)]
    upper = below(capacity - a)  # J2 is (C/2, C - a]
    mid = below(np.array(half))
    lower = below(a - 1)  # J3 is [a, C/2]
    n1 = count_le[-1] - count_le[upper]
    n2 = count_le[upper] - count_le[mid]
    s2 = sum_le[upper] - sum_le[mid]
    s3 = sum_le[mid] - sum_le[lower]
    spill = s3 - (n2 * capacity - s2)
    extra = np.where(spill > 0, -(-spill // capacity), 0)
    return a, n1 + n2 + extra


class _SingleFills:
    """The single-fill bound at any threshold ``a`` in O(k): items <= C/2 and the rooms of the
    items > C/2 merged once into one ascending value axis."""

    def __init__(self, sizes: np.ndarray, counts: np.ndarray, capacity: int) -> None:
        big = sizes > capacity // 2
        self.capacity = capacity
        self.packs = int(counts[big].sum())
        rooms, room_counts = capacity - sizes[big], counts[big]
        self.values = np.union1d(sizes[~big], rooms)
        self.items = np.zeros(len(self.values), dtype=np.int64)
        self.items[np.searchsorted(self.values, sizes[~big])] = counts[~big]
        self.rooms = np.zeros(len(self.values), dtype=np.int64)
        self.rooms[np.searchsorted(self.values, rooms)] = room_counts

    def bound(self, a: int) -> int:
        """Packs of items > C/2, plus what J3 = [a, C/2] cannot put in their rooms: rooms in
        [a, 2a) take one J3 item each (at most the largest matched volume), rooms >= 2a all."""
        values = self.values
        first, second = np.searchsorted(values, [a, 2 * a])
        v = values[first:]
        items = self.items[first:]
        single_rooms = np.where(v < 2 * a, self.rooms[first:], 0)
        whole = int((values[second:] * self.rooms[second:]).sum())
        rest = int((v * items).sum()) - _matched_volume(v, items, single_rooms) - whole
        return self.packs + max(0, -(-rest // self.capacity))


def _matched_volume(values: np.ndarray, items: np.ndarray, rooms: np.ndarray) -> int:
    """Largest total size of items placed one per room (an item into a room at least its size);
    ``items[i]`` / ``rooms[i]``: how many items / rooms have size ``values[i]`` (ascending).

    Greedy by decreasing size is optimal (a transversal matroid) and takes, among the items of
    size >= x, ``m(x) = min over y >= x of (items in [x, y) + rooms >= y)`` (Hall's condition
    on nested neighbourhoods), so the volume is ``sum over x of x * (m(x) - m(next x))``.

    >>> _matched_volume(np.array([3, 4, 5, 6]), np.array([2, 0, 1, 0]), np.array([0, 1, 0, 1]))
    8
    """
    items_ge = np.cumsum(items[::-1])[::-1]
    rooms_ge = np.cumsum(rooms[::-1])[::-1]
    slack = np.minimum(np.minimum.accumulate((rooms_ge - items_ge)[::-1])[::-1], 0)
    matched_ge = items_ge + slack
    taken = matched_ge - np.append(matched_ge[1:], 0)
    return int((taken * values).sum())


def _ccm_bound(sizes: np.ndarray, counts: np.ndarray, capacity: int, lams: np.ndarray) -> int:
    """The CCM dual-feasible-function bound at each ``lam`` (module docstring); the largest."""
    lam = lams[:, None]
    s = sizes[None, :]
    value = np.where(
        2 * s > capacity,
        2 * (capacity // lam - (capacity - s) // lam),
        np.where(2 * s == capacity, capacity // lam, 2 * (s // lam)),
    )
    per_pack = 2 * (capacity // lams)
    total = value @ counts
    return int((-(-total // per_pack)).max())
