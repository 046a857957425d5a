"""Order-preserving planners: next-fit ("sequential") and windowed best fit ("window").

``sequential`` is NeMo AutoModel's and torchtune's rule: walk the sequences in order and start a
new pack whenever the next one does not fit (the exact order; a fifth of the tokens lost on real
length mixes). ``window`` keeps the order approximately and wastes almost nothing: each pack
starts with the oldest sequence not yet placed, then takes the largest that still fits from the
next ``window`` sequences, so a sequence moves at most ``window - 1`` places earlier and is never
delayed past the moment it becomes the oldest.

>>> units = np.array([6, 6, 3, 3, 4])
>>> offsets = next_fit(units, capacity=10)
>>> offsets.tolist()                     # packs [6] [6, 3] [3, 4]
[0, 1, 3, 5]
>>> indices, offsets = window_best_fit(units, capacity=10, window=4)
>>> [indices[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
[[0, 2], [1, 4], [3]]
"""

from __future__ import annotations

import bisect

import numpy as np


def next_fit(units: np.ndarray, capacity: int) -> np.ndarray:
    """Pack offsets (num_packs+1,) int64 of order-preserving next fit over ``units`` (each <= capacity).

    Pack ``i`` holds items ``offsets[i]:offsets[i+1]`` in their original order.
    """
    ends = np.cumsum(units, dtype=np.int64)
    before = ends - units
    # next_start[i]: where a pack opened at item i would end (first item that no longer fits)
    next_start = np.searchsorted(ends, before + capacity, side="right").tolist()
    n = len(units)
    starts = [0]
    i = 0
    while i < n:
        i = next_start[i]
        starts.append(i)
    return np.asarray(starts, dtype=np.int64)


def window_best_fit(units: np.ndarray, capacity: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Windowed best fit (see the module docstring): ``(indices, offsets)`` over item ids.

    ``indices`` (n,) int64 lists the items pack by pack, each pack in placement order;
    ``offsets`` (num_packs+1,) int64 delimit the packs.
    """
    n = len(units)
    size = units.tolist()
    # candidate key: larger size first, then older item; bisect finds "largest that fits"
    key_of = [s * n + (n - 1 - i) for i, s in enumerate(size)]
    candidates: list[int] = []
    placed = bytearray(n)
    indices: list[int] = []
    offsets = [0]
    oldest = 0
    horizon = 0  # items [0, horizon) have entered the candidate list
    while True:
        while oldest < n and placed[oldest]:
            oldest += 1
        if oldest == n:
            break
        for i in range(horizon, min(n, oldest + window)):
            bisect.insort(candidates, key_of[i])
        horizon = max(horizon, min(n, oldest + window))
        del candidates[bisect.bisect_left(candidates, key_of[oldest])]
        placed[oldest] = 1
        indices.append(oldest)
        room = capacity - size[oldest]
        while room and candidates:
            k = bisect.bisect_right(candidates, room * n + n - 1) - 1
            if k < 0:
                break
            key = candidates.pop(k)
            item = n - 1 - key % n
            placed[item] = 1
            indices.append(item)
            room -= size[item]
        offsets.append(len(indices))
    return np.asarray(indices, dtype=np.int64), np.asarray(offsets, dtype=np.int64)
