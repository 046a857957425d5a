"""Lower bounds on the number of packs: the Martello–Toth L2 bound.

The sum bound ``ceil(sum / C)`` ignores that two items larger than half a pack never share
one. L2 (Martello & Toth, 1990) fixes that: for every threshold ``a <= C/2``, items larger than
``C - a`` each need a pack of their own (J1), items in ``(C/2, C - a]`` too (J2), and items in
``[a, C/2]`` (J3) can only use J2's leftover room or new packs:

    L(a) = |J1| + |J2| + max(0, ceil((sum(J3) - (|J2| C - sum(J2))) / C)),   L2 = max_a L(a)

``L(0)`` alone is already at least ``max(ceil(sum / C), #items > C/2)``.

>>> l2_lower_bound(np.bincount([6, 6, 6, 4, 4, 4], minlength=11), capacity=10)
3
>>> l2_lower_bound(np.bincount([6, 6, 6, 5, 5], minlength=11), capacity=10)   # sum bound says 3
4
"""

from __future__ import annotations

import numpy as np


def l2_lower_bound(counts: np.ndarray, capacity: int) -> int:
    """Martello–Toth L2 for ``counts[s]`` items of size ``s`` in packs of ``capacity``.

    Args:
        counts: (capacity+1,) non-negative integers, item sizes in ``[1, capacity]``.
        capacity: pack capacity (same units as the sizes).
    """
    counts = np.asarray(counts, dtype=np.int64)
    sizes = np.arange(len(counts), dtype=np.int64)
    # prefix counts / sums with a leading 0 so that index x+1 means "sizes <= x"
    count_le = np.concatenate(([0], np.cumsum(counts)))
    sum_le = np.concatenate(([0], np.cumsum(counts * sizes)))
    half = capacity // 2  # "size <= C/2"
    a = np.arange(half + 1, dtype=np.int64)
    upper = capacity - a  # J2 is (C/2, C - a]
    n_total = count_le[-1]
    n1 = n_total - count_le[upper + 1]
    n2 = count_le[upper + 1] - count_le[half + 1]
    s2 = sum_le[upper + 1] - sum_le[half + 1]
    s3 = sum_le[half + 1] - sum_le[a]  # sizes in [a, C/2]
    spill = s3 - (n2 * capacity - s2)
    extra = np.where(spill > 0, -(-spill // capacity), 0)
    return int((n1 + n2 + extra).max())
