"""The placement search's loop a row at a time, compiled by numba when it is installed.

``thdpack.plan.place`` runs its greedy over many rows at once with numpy, whose per-call overhead
is the cost for a few hundred rows. ``search_rows`` is the same greedy written as loops over one
row's items, options and ranks, which numba compiles (``pip install 'thdpack[fast]'``). Both take
the same integer inputs and break ties the same way, so their results are equal; the tests run
this function compiled and as plain Python against the numpy loop.

Legend: ``K`` rows, ``M`` item positions, ``O`` group options, ``R`` ranks, ``G`` group sizes,
``J`` ranks of a group (1 when every rank of a group costs the same).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from thdpack._optional import has_module


def search_rows(
    level_K: np.ndarray,
    count_K: np.ndarray,
    reserve_KM: np.ndarray,
    share_GKM: np.ndarray,
    cost_GKMJ: np.ndarray,
    size_O: np.ndarray,
    start_O: np.ndarray,
    size_index_O: np.ndarray,
    halves_O: np.ndarray,
    open_device_O: np.ndarray,
    open_host_O: np.ndarray,
    lead: int,
    two_streams: bool,
    split: int,
    cp_size: int,
    budget: int,
    option_KM: np.ndarray,
    tokens_KR: np.ndarray,
    cost_KR: np.ndarray,
    host_KR: np.ndarray,
) -> None:
    """Place every row (``thdpack.plan.place``'s greedy and its searches again with reserved
    items) into the outputs: ``option_KM`` (filled with -1 by the caller), ``tokens_KR``,
    ``cost_KR`` (the device's) and ``host_KR`` (zeros).

    Tables: ``reserve_KM`` each item's TE slot; per group size (``G``, ``size_index_O`` maps an
    option to it) ``share_GKM`` the tokens each rank of the group holds and ``cost_GKMJ`` the cost
    on group rank ``j`` (``J == 1``: every rank of the group the same); ``split`` is the option of
    all ranks. ``halves_O``: (O, 2) the two options of half the size that make up an option, -1
    where its ranks are read one by one (a single rank, or a size that is not twice the next).
    Calls (zeros for tiles and pairs): an option's group costs each of its ranks ``open_device_O``
    on the device and ``open_host_O`` on the host the first time the row uses it; with
    ``two_streams`` a rank costs ``max(device, host + lead)``, else its device cost alone.

    A row that gets stuck is searched again from its first item with the items from ``tail`` on
    reserved, ``tail`` backing off 1, 4, 16, ... items before where it got stuck (numpy's loop runs
    the same rounds). A search again repeats the last one's choices while every option fits or not
    as it did then: the same state and the same options give the same choice.
    """
    num_options, num_sizes = len(size_O), share_GKM.shape[0]
    num_items = reserve_KM.shape[1]
    uniform = cost_GKMJ.shape[3] == 1
    calls = two_streams or open_device_O.any()
    lightest = np.zeros(num_options, dtype=np.int64)  # the device's (host and device combined: below)
    host_max = np.zeros(num_options, dtype=np.int64)
    held = np.zeros(num_options, dtype=np.int64)
    opened = np.zeros(num_options, dtype=np.bool_)
    share_G = np.zeros(num_sizes, dtype=np.int64)
    add_GJ = np.zeros((num_sizes, cost_GKMJ.shape[3]), dtype=np.int64)
    after = np.zeros(num_items + 1, dtype=np.int64)
    last = np.full(num_items, -1, dtype=np.int64)
    for row in range(len(count_K)):
        level = level_K[row]
        # room every rank keeps after item m: the reserved items after m (all of them before the tail)
        after[num_items] = 0
        for m in range(num_items - 1, -1, -1):
            after[m] = after[m + 1] + reserve_KM[row, m] // cp_size
        tokens, cost, host = tokens_KR[row], cost_KR[row], host_KR[row]
        opened[:] = False
        tail, back_off = num_items, 1
        last_tail = last_stuck = -1  # the last search of this row (none yet)
        while True:
            stuck = -1
            replaying = last_stuck >= 0
            for m in range(count_K[row]):
                in_tail = m >= tail
                keep = after[m + 1] if in_tail else after[tail]
                for s in range(num_sizes):
                    share_G[s] = share_GKM[s, row, m]
                    for j in range(add_GJ.shape[1]):
                        add_GJ[s, j] = cost_GKMJ[s, row, m, j]
                # every option's busiest rank and fullest rank; options come largest first, so in
                # reverse order an option's halves are done before it
                for o in range(num_options - 1, -1, -1):
                    if halves_O[o, 0] >= 0:
                        lightest[o] = max(lightest[halves_O[o, 0]], lightest[halves_O[o, 1]])
                        held[o] = max(held[halves_O[o, 0]], held[halves_O[o, 1]])
                        if two_streams:
                            host_max[o] = max(host_max[halves_O[o, 0]], host_max[halves_O[o, 1]])
                    else:
                        a = start_O[o]
                        lightest[o], held[o] = cost[a], tokens[a]
                        for r in range(a + 1, a + size_O[o]):
                            lightest[o] = max(lightest[o], cost[r])
                            held[o] = max(held[o], tokens[r])
                        if two_streams:
                            host_max[o] = host[a]
                            for r in range(a + 1, a + size_O[o]):
                                host_max[o] = max(host_max[o], host[r])
                held_all, busiest_all = held[split], lightest[split]
                if two_streams:  # a rank costs max(device, host + lead): over a group, the two maxima apart
                    busiest_all = max(busiest_all, host_max[split] + lead)
                # an option fits when every rank keeps room for the reserved items; a stuck row fits
                # nothing more and finishes with its items split over all ranks
                free = stuck < 0
                stuck_now = True
                if free:
                    for o in range(num_options):
                        if max(held[o] + share_G[size_index_O[o]], held_all) + keep <= budget:
                            stuck_now = False
                            break
                    if stuck_now:
                        stuck = m
                if replaying:  # the last search's choice stands while every option fits as it did then
                    replaying = m < last_stuck and not stuck_now
                    last_keep = after[m + 1] if m >= last_tail else after[last_tail]
                    forced, last_forced = in_tail, m >= last_tail
                    for o in range(num_options if replaying else 0):
                        peak = max(held[o] + share_G[size_index_O[o]], held_all)
                        now = peak + keep <= budget or (o == split and forced)
                        if now != (peak + last_keep <= budget or (o == split and last_forced)):
                            replaying = False
                            break
                best = last[m] if replaying else -1
                k0 = k1 = k2 = k3 = k4 = 0
                for o in range(0 if replaying else num_options):
                    size_index = size_index_O[o]
                    peak = held[o] + share_G[size_index]
                    if not ((free and max(peak, held_all) + keep <= budget) or (o == split and (in_tail or stuck_now))):
                        continue  # the reserved items split (over all ranks) always fit
                    g, a = size_O[o], start_O[o]
                    light = max(lightest[o], host_max[o] + lead) if two_streams else lightest[o]
                    if uniform and calls:
                        closed = not opened[o]  # the row's first use of this group pays its call
                        add = add_GJ[size_index, 0] + (open_device_O[o] if closed else 0)
                        host_add = open_host_O[o] if closed else 0
                        total = (add + host_add) * g
                        busiest = max(lightest[o] + add, busiest_all)
                        if two_streams:
                            busiest = max(busiest, host_max[o] + host_add + lead)
                    elif uniform:
                        add = add_GJ[size_index, 0]
                        total = add * g
                        busiest = max(lightest[o] + add, busiest_all)
                    else:
                        total = 0
                        busiest = busiest_all
                        for j in range(g):
                            add = add_GJ[size_index, j]
                            total += add
                            busiest = max(busiest, cost[a + j] + add)
                    # the first option with the smallest (max(busiest, level), total, g, lightest, peak)
                    key0 = max(busiest, level)
                    if best >= 0:
                        if key0 != k0:
                            if key0 > k0:
                                continue
                        elif total != k1:
                            if total > k1:
                                continue
                        elif g != k2:
                            if g > k2:
                                continue
                        elif light != k3:
                            if light > k3:
                                continue
                        elif peak >= k4:
                            continue
                    best, k0, k1, k2, k3, k4 = o, key0, total, g, light, peak
                option_KM[row, m] = best
                g, a, size_index = size_O[best], start_O[best], size_index_O[best]
                for j in range(g):
                    tokens[a + j] += share_G[size_index]
                    cost[a + j] += add_GJ[size_index, 0 if uniform else j]
                if calls and not opened[best]:  # the group's call, paid once
                    opened[best] = True
                    for j in range(g):
                        cost[a + j] += open_device_O[best]
                        host[a + j] += open_host_O[best]
            if stuck < 0:
                break
            # search again with the items from a little before the stuck one reserved
            last[:] = option_KM[row]
            last_tail, last_stuck = tail, stuck
            tail, back_off = max(stuck - back_off, 0), back_off * 4
            tokens[:] = 0
            cost[:] = 0
            host[:] = 0
            opened[:] = False


def option_halves(size_O: np.ndarray, start_O: np.ndarray) -> np.ndarray:
    """(O, 2) int64 the two options of half the size that make up each option (``search_rows``'
    ``halves_O``), -1 where there are none.

    >>> option_halves(np.array([4, 2, 2, 1, 1, 1, 1]), np.array([0, 0, 2, 0, 1, 2, 3])).tolist()
    [[1, 2], [3, 4], [5, 6], [-1, -1], [-1, -1], [-1, -1], [-1, -1]]
    """
    groups = list(zip(size_O.tolist(), start_O.tolist(), strict=True))
    where = {group: o for o, group in enumerate(groups)}
    halves = np.full((len(size_O), 2), -1, dtype=np.int64)
    for o, (g, a) in enumerate(groups):
        low, high = where.get((g // 2, a)), where.get((g // 2, a + g // 2))
        if g % 2 == 0 and low is not None and high is not None:
            halves[o] = low, high
    return halves


@functools.cache
def compiled_search_rows() -> Callable[..., None] | None:
    """``search_rows`` compiled by numba (cached on disk), or None without numba."""
    if not has_module("numba"):
        return None
    import numba

    return numba.njit(cache=True, nogil=True)(search_rows)
