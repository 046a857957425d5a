"""Choose each sequence's CP group within a pack: greedy, vectorised over many packs at once.

Per pack (a row), the items go costliest first, each to the option (whole on one rank, or split
over an aligned group of ranks) that keeps the pack's busiest rank cheapest among those that leave
room; ties prefer less work, then smaller groups, then lighter ranks. Each item reserves its TE
slot, so every row can be placed, and a row whose busiest rank would cost more than under
Transformer Engine's layout takes that layout. Costs are integers, so ties are exact and the
result deterministic. docs/design/cp_placement.md (section 7) has the rules in full;
``thdpack.plan.place_compiled`` runs the same greedy compiled.

Legend: ``K`` rows (packs or pack templates), ``M`` item positions, ``O`` group options,
``R`` ranks, ``C`` columns of a cost table, ``G`` group sizes, ``J`` ranks of a group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

from thdpack.layout.rules import group_options, slot_lengths
from thdpack.plan.cp_cost import Costing, call_costs, split_cost, uniform_split, whole_cost
from thdpack.plan.place_compiled import compiled_search_rows, option_halves

_BIG = np.iinfo(np.int64).max
Engine = Literal["auto", "numpy", "compiled"]
COMPILED_FROM = 4096
"""Rows x item positions from which ``engine="auto"`` runs the compiled loop when numba is installed:
below it numpy's loop is about as fast, and a small plan does not load numba (a third of a second)."""


def place_rows(
    lengths_KM: np.ndarray,
    reserve_KM: np.ndarray,
    valid_KM: np.ndarray,
    *,
    cp_size: int,
    budget: int,
    cost_model: Costing,
    sizes: Sequence[int] | None = None,
    fill_density: float = 0.0,
    engine: Engine = "auto",
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Place every row's items; return ``(option_KM, tokens_KR, cost_KR, te_cost_KR)``.

    Args:
        lengths_KM: (K, M) int64 tokens of each item (a whole item takes exactly this many).
        reserve_KM: (K, M) int64 the slot each item reserves: its TE slot (a multiple of
            ``2*cp_size``, ``>= lengths_KM``).
        valid_KM: (K, M) bool, which positions hold an item; a row's items come first, costliest
            first.
        cp_size: ranks.
        budget: tokens per rank (``pack_size / cp_size``); each row's reserves must sum to at most
            ``cp_size * budget``.
        cost_model: what a rank's load counts (``thdpack.plan.cp_cost``).
        sizes: the group sizes to use (default: all allowed; ``cp_size`` is always used).
        fill_density: cost per token of the work that will fill each row's free room
            (``cp_size * budget`` minus its reserves) after this placement: it raises the level
            the search treats as free.
        engine: ``"numpy"`` (the vectorised loop), ``"compiled"`` (numba's; ``ImportError`` without
            it) or ``"auto"`` (compiled from ``COMPILED_FROM`` positions when numba is installed).
            The results are equal.

    Returns:
        option_KM: (K, M) int64 index into ``group_options(cp_size, sizes)``; -1 where invalid.
        tokens_KR: (K, R) int64 tokens each rank holds.
        cost_KR: (K, R) int64 each rank's cost (device and host combined, with call costs).
        te_cost_KR: (K, R) int64 each rank's cost under TE's layout of the row's items.

    >>> opt, tok, cost, te = place_rows(np.array([[200, 100, 100, 50]]), np.array([[200, 104, 104, 56]]),
    ...                                 np.ones((1, 4), bool), cp_size=4, budget=128, cost_model="tiles")
    >>> group_options(4)[0][opt[0]].tolist()   # 200 on ranks 0-1, the 100s whole on 2 and 3, 50 on 2-3
    [2, 1, 1, 2]
    >>> tok.tolist(), cost.tolist(), te.tolist()
    ([[100, 100, 126, 126]], [[2, 2, 3, 3]], [[16, 16, 16, 16]])
    """
    sizes = tuple(sorted({*(sizes or group_options(cp_size)[0].tolist()), cp_size}))
    valid_KM = np.asarray(valid_KM, dtype=bool)
    count_K = valid_KM.sum(axis=1)
    lengths_KM = np.where(valid_KM, lengths_KM, 0).astype(np.int64)
    reserve_KM = np.where(valid_KM, reserve_KM, 0).astype(np.int64)
    num_rows, num_items = lengths_KM.shape
    # rows with more items first: at item position m only a prefix of the rows is active
    order_K = np.argsort(-count_K, kind="stable")
    loop = _loop(engine, num_rows * num_items)
    search = _Search(
        lengths_KM[order_K], reserve_KM[order_K], count_K[order_K], cp_size, budget, cost_model, sizes, loop
    )
    level_K = search.level(fill_density)
    if loop is None:
        rows = np.arange(num_rows)
        option_KM, tokens_KR, cost_KR, stuck_K = search.run(rows, np.full(num_rows, num_items), level_K)
        back_off = 1
        while (stuck_K >= 0).any():
            rows, stuck_K = rows[stuck_K >= 0], stuck_K[stuck_K >= 0]
            placed = search.run(rows, np.maximum(stuck_K - back_off, 0), level_K[rows])
            option_KM[rows], tokens_KR[rows], cost_KR[rows], stuck_K = placed
            back_off *= 4
    else:  # the row loop searches a stuck row again itself
        option_KM, tokens_KR, cost_KR = search.run_rows(level_K)
    assert (tokens_KR <= budget).all(), "a placed row holds no rank over its budget"
    te_option_KM, te_tokens_KR, te_cost_KR = search.all_split()
    # never worse than TE's layout of the same items (ties keep the search's: less work, less
    # communication)
    worse_K = cost_KR.max(axis=1) > te_cost_KR.max(axis=1)
    option_KM[worse_K], tokens_KR[worse_K], cost_KR[worse_K] = (
        te_option_KM[worse_K],
        te_tokens_KR[worse_K],
        te_cost_KR[worse_K],
    )
    back_K = np.empty_like(order_K)
    back_K[order_K] = np.arange(num_rows)
    return option_KM[back_K], tokens_KR[back_K], cost_KR[back_K], te_cost_KR[back_K]


def _loop(engine: Engine, positions: int) -> Callable[..., None] | None:
    """The row-at-a-time loop ``engine`` asks for (None: numpy's)."""
    if engine == "numpy":
        return None
    compiled = compiled_search_rows()
    if engine == "compiled":
        if compiled is None:
            raise ImportError("place_rows(engine='compiled') needs numba, which is not installed; "
                              "pip install 'thdpack[fast]'")  # fmt: skip
        return compiled
    if engine != "auto":
        raise ValueError(f"unknown engine {engine!r}; valid: auto, numpy, compiled")
    return compiled if positions >= COMPILED_FROM else None


def _first_min(key_OK: np.ndarray, allowed_OK: np.ndarray) -> np.ndarray:
    """Narrow ``allowed_OK`` (O, K) to the options whose ``key`` is the row's smallest allowed value."""
    best_K = np.where(allowed_OK, key_OK, _BIG).min(axis=0)
    return allowed_OK & (key_OK == best_K)


class _Search:
    """The greedy over rows sorted by item count (descending), run on any subset of them."""

    def __init__(
        self,
        lengths_KM: np.ndarray,
        reserve_KM: np.ndarray,
        count_K: np.ndarray,
        cp_size: int,
        budget: int,
        cost_model: Costing,
        sizes: tuple[int, ...],
        loop: Callable[..., None] | None = None,
    ) -> None:
        self.lengths_KM, self.reserve_KM, self.count_K = lengths_KM, reserve_KM, count_K
        self.loop = loop
        self.cp_size, self.budget, self.cost_model = cp_size, budget, cost_model
        self.size_O, start_O = group_options(cp_size, sizes)
        self.sizes_desc = tuple(dict.fromkeys(self.size_O.tolist()))
        self.all_split_option = int(np.flatnonzero(self.size_O == cp_size)[0])
        ranks_R = np.arange(cp_size)
        self.member_OR = (start_O[:, None] <= ranks_R) & (ranks_R < (start_O + self.size_O)[:, None])
        self.member_RO = np.ascontiguousarray(self.member_OR.T)
        self.local_OR = np.where(self.member_OR, ranks_R - start_O[:, None], 0)
        # per item and group size: the cost on each group rank and the tokens each group rank holds
        # (0 at positions without an item; a split item costs every rank of its group the same
        # under tiles: one column)
        self.uniform = uniform_split(cost_model)
        self.size_index_O = np.array([self.sizes_desc.index(g) for g in self.size_O.tolist()])
        valid_KM = np.arange(lengths_KM.shape[1]) < count_K[:, None]
        lengths_V = lengths_KM[valid_KM]
        costs, shares = [], []
        for g in self.sizes_desc:
            if g == 1:
                cost_VJ, share_V = whole_cost(lengths_V, cost_model)[:, None], lengths_V
            else:
                slot_V = slot_lengths(lengths_V, g)
                cost_VJ, share_V = split_cost(lengths_V, slot_V, g, cost_model), slot_V // g
            cost_KMJ = np.zeros((*lengths_KM.shape, 1 if self.uniform else g), dtype=np.int64)
            cost_KMJ[valid_KM] = cost_VJ[:, : cost_KMJ.shape[2]]
            share_KM = np.zeros(lengths_KM.shape, dtype=np.int64)
            share_KM[valid_KM] = share_V
            costs.append(cost_KMJ)
            shares.append(share_KM)
        self.cost_per_rank = costs  # [(K, M, g)] per size: the pairs model, TE's layout
        self.start_O = start_O
        # a loaded model's per-call costs: an option's group costs its ranks a call the first time
        # the row uses it; where device and host add, the host's share joins the device's
        self.calls = call_costs(cost_model, self.sizes_desc, budget)
        self.two_streams = self.calls is not None and self.calls.lead is not None
        if self.calls is not None:
            assert self.uniform, "call costs come with models that cost a group's ranks the same"
            device_O, host_O = (np.array([c[g] for g in self.size_O.tolist()], dtype=np.int64)
                                for c in (self.calls.device, self.calls.host))  # fmt: skip
            self.open_device_O = device_O if self.two_streams else device_O + host_O
            self.open_host_O = host_O if self.two_streams else np.zeros_like(host_O)
        if loop is None:  # (G, M, K): a numpy step reads one item position of every row
            self.cost_GMK = np.ascontiguousarray(np.stack([c[..., 0] for c in costs]).transpose(0, 2, 1))
            self.share_GMK = np.ascontiguousarray(np.stack(shares).transpose(0, 2, 1))
        else:  # (G, K, M): the row-at-a-time loop reads one row's items, a rank axis J last
            self.share_GKM = np.ascontiguousarray(np.stack(shares))
            self.halves_O = option_halves(self.size_O, start_O)
            width = 1 if self.uniform else cp_size
            self.cost_GKMJ = np.zeros((len(costs), *lengths_KM.shape, width), dtype=np.int64)
            for i, cost_KMJ in enumerate(costs):
                self.cost_GKMJ[i, ..., : min(width, cost_KMJ.shape[2])] = cost_KMJ[..., :width]

    def level(self, fill_density: float) -> np.ndarray:
        """(K,) a lower bound of each row's busiest rank: every item whole and the work filling the
        free room (``fill_density`` per token), perfectly balanced, and each rank's cheapest call."""
        whole_K = whole_cost(self.lengths_KM, self.cost_model).sum(axis=1)
        free_K = self.cp_size * self.budget - self.reserve_KM.sum(axis=1)
        level_K = (whole_K + np.floor(fill_density * free_K).astype(np.int64)) // self.cp_size
        if self.calls is None:
            return level_K
        # with calls every rank also makes one call at least, its cheapest (the local call), on the
        # device and, where it launches ahead, on the host
        level_K = level_K + int(self.open_device_O.min())
        if self.two_streams:
            level_K = np.maximum(level_K, int(self.open_host_O.min()) + self.calls.lead)
        return level_K

    def _group_max(self, x_RK: np.ndarray) -> np.ndarray:
        """(O, K) the largest of ``x_RK`` (R, K) over each option's ranks."""
        by_size = {1: x_RK}
        smaller = 1
        for g in sorted(self.sizes_desc):
            if g == 1:
                continue
            if g == 2 * smaller:  # pairs of the next smaller groups: one elementwise maximum, no reduction
                half = by_size[smaller]
                by_size[g] = np.maximum(half[0::2], half[1::2])
            else:
                by_size[g] = x_RK.reshape(self.cp_size // g, g, -1).max(axis=1)
            smaller = g
        return np.concatenate([by_size[g] for g in self.sizes_desc], axis=0)

    def run(
        self, rows_K: np.ndarray, tail_K: np.ndarray, level_K: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(option_KM, tokens_KR, cost_KR, stuck_K)`` of ``rows_K`` (ascending), their items from
        ``tail_K`` on reserved. ``stuck_K``: the position of the item that fit nowhere (-1 when the
        row was placed); such a row is finished with its items split over all ranks and is invalid."""
        cp_size, budget = self.cp_size, self.budget
        num_rows, num_items = len(rows_K), self.lengths_KM.shape[1]
        count_K = self.count_K[rows_K]
        option_KM = np.full((num_rows, num_items), -1, dtype=np.int64)
        # the loop works option-major ((O, k), (R, k)): reductions over the options or ranks then run
        # down columns, several times faster than along short rows
        tokens_RK = np.zeros((cp_size, num_rows), dtype=np.int64)
        cost_RK = np.zeros((cp_size, num_rows), dtype=np.int64)  # the device's (with the host's where they add)
        host_RK = np.zeros((cp_size, num_rows), dtype=np.int64)  # the host's calls, where it launches ahead
        open_OK = np.zeros((len(self.size_O), num_rows), dtype=bool)  # groups whose call the row pays already
        stuck_K = np.full(num_rows, -1, dtype=np.int64)
        share_KM = self.reserve_KM[rows_K] // cp_size
        # room every rank keeps after item m: the reserved items after m (all of them before the tail)
        after_KM = np.cumsum(share_KM[:, ::-1], axis=1)[:, ::-1] - share_KM
        suffix_KM = np.concatenate((after_KM + share_KM, np.zeros((num_rows, 1), np.int64)), axis=1)
        tail_share_K = np.take_along_axis(suffix_KM, tail_K[:, None], axis=1)[:, 0]
        after_MK = np.ascontiguousarray(after_KM.T)
        size_O1 = self.size_O[:, None]
        split = self.all_split_option
        all_rows = np.array_equal(rows_K, np.arange(len(self.lengths_KM)))  # the first run: slices, not gathers
        for m in range(num_items):
            k = int(np.searchsorted(-count_K, -m, side="left"))  # rows with more than m items
            if k == 0:
                break
            rows = slice(0, k) if all_rows else rows_K[:k]
            share_OK = self.share_GMK[:, m, rows][self.size_index_O]
            in_tail_K = m >= tail_K[:k]
            keep_K = np.where(in_tail_K, after_MK[m, :k], tail_share_K[:k])
            lightest_OK = self._group_max(cost_RK[:, :k])
            held_OK = self._group_max(tokens_RK[:, :k])
            peak_OK = held_OK + share_OK
            if self.uniform and self.calls is None:
                add_OK = self.cost_GMK[:, m, rows][self.size_index_O]
                # the group of all ranks' maximum is the row's busiest rank so far
                busiest_OK = np.maximum(lightest_OK + add_OK, lightest_OK[split])
                total_OK = add_OK * size_O1
            elif self.uniform:
                add_OK, host_add_OK, lightest_OK, busiest_OK = self._with_calls(
                    self.cost_GMK[:, m, rows][self.size_index_O], lightest_OK, host_RK[:, :k], open_OK[:, :k]
                )
                total_OK = (add_OK + host_add_OK) * size_O1
            else:
                add_KOR = self._per_rank_cost(rows, m)
                busiest_OK = (cost_RK[:, :k].T[:, None, :] + add_KOR).max(axis=2).T
                total_OK = add_KOR.sum(axis=2).T
            # every rank, not only the option's, must keep room for the reserved items
            fits_OK = np.maximum(peak_OK, held_OK[split]) + keep_K <= budget
            fits_OK &= stuck_K[:k] < 0
            stuck = ~fits_OK.any(axis=0)
            stuck_K[:k][stuck & (stuck_K[:k] < 0)] = m
            fits_OK[split] |= in_tail_K | stuck  # the reserved items split always fit
            choice_OK = _first_min(np.maximum(busiest_OK, level_K[:k]), fits_OK)
            choice_OK = _first_min(total_OK, choice_OK)
            choice_OK = _first_min(np.broadcast_to(size_O1, choice_OK.shape), choice_OK)
            choice_OK = _first_min(lightest_OK, choice_OK)
            choice_OK = _first_min(peak_OK, choice_OK)
            chosen_K = np.argmax(choice_OK, axis=0)
            at = np.arange(k)
            option_KM[:k, m] = chosen_K
            member_RK = self.member_RO[:, chosen_K]
            tokens_RK[:, :k] += member_RK * share_OK[chosen_K, at]
            if self.uniform:
                cost_RK[:, :k] += member_RK * add_OK[chosen_K, at]
            else:
                cost_RK[:, :k] += add_KOR[at, chosen_K].T
            if self.calls is not None:
                host_RK[:, :k] += member_RK * host_add_OK[chosen_K, at]
                open_OK[chosen_K, at] = True
        return option_KM, tokens_RK.T.copy(), self._combined(cost_RK.T, host_RK.T), stuck_K

    def _with_calls(
        self, add_OK: np.ndarray, device_OK: np.ndarray, host_RK: np.ndarray, open_OK: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """An item's options with the call of each group the row does not use yet: ``(add_OK,
        host_add_OK, rank_OK, busiest_OK)``, what each option adds to the device and to the host
        on each of its ranks, each option's costliest rank now (device and host combined) and the
        row's busiest rank after each option. ``device_OK``: each option's costliest rank's device."""
        closed_OK = ~open_OK
        add_OK = add_OK + closed_OK * self.open_device_O[:, None]
        host_add_OK = closed_OK * self.open_host_O[:, None]
        if self.two_streams:  # max over a group of max(device, host + lead): the two maxima apart
            host_OK = self._group_max(host_RK) + self.calls.lead
            rank_OK = np.maximum(device_OK, host_OK)
            after_OK = np.maximum(device_OK + add_OK, host_OK + host_add_OK)
        else:
            rank_OK, after_OK = device_OK, device_OK + add_OK
        return add_OK, host_add_OK, rank_OK, np.maximum(after_OK, rank_OK[self.all_split_option])

    def _combined(self, device_KR: np.ndarray, host_KR: np.ndarray) -> np.ndarray:
        """(K, R) each rank's cost from its device and host parts (the device's alone without calls)."""
        if self.calls is None:
            return np.ascontiguousarray(device_KR)
        return self.calls.combine(device_KR, host_KR)

    def run_rows(self, level_K: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(option_KM, tokens_KR, cost_KR)`` of every row, searched again until placed, by the
        row-at-a-time loop (``thdpack.plan.place_compiled``)."""
        num_rows, num_items = self.lengths_KM.shape
        option_KM = np.full((num_rows, num_items), -1, dtype=np.int64)
        tokens_KR = np.zeros((num_rows, self.cp_size), dtype=np.int64)
        cost_KR = np.zeros((num_rows, self.cp_size), dtype=np.int64)
        host_KR = np.zeros((num_rows, self.cp_size), dtype=np.int64)
        tables = (self.reserve_KM, self.share_GKM, self.cost_GKMJ, self.size_O, self.start_O, self.size_index_O,
                  self.halves_O)  # fmt: skip
        no_calls = np.zeros(len(self.size_O), dtype=np.int64)
        calls = (no_calls, no_calls, 0, False) if self.calls is None else (
            self.open_device_O, self.open_host_O, self.calls.lead or 0, self.two_streams)  # fmt: skip
        self.loop(np.asarray(level_K, dtype=np.int64), self.count_K.astype(np.int64), *tables, *calls,
                  self.all_split_option, self.cp_size, self.budget, option_KM, tokens_KR, cost_KR, host_KR)  # fmt: skip
        return option_KM, tokens_KR, self._combined(cost_KR, host_KR)

    def _per_rank_cost(self, rows: np.ndarray | slice, m: int) -> np.ndarray:
        """(k, O, R) cost of item ``m`` of ``rows`` on every rank of every option (pairs model)."""
        cost_per_size = [cost_KMJ[rows, m] for cost_KMJ in self.cost_per_rank]  # (k, g) per group size
        out = np.zeros((len(cost_per_size[0]), len(self.size_O), self.cp_size), dtype=np.int64)
        for i, cost_KJ in enumerate(cost_per_size):
            of_g = self.size_index_O == i
            out[:, of_g] = np.where(self.member_OR[of_g], cost_KJ[:, self.local_OR[of_g]], 0)
        return out

    def all_split(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(option_KM, tokens_KR, cost_KR)`` of TE's layout: every item on all ranks."""
        cp_size = self.cp_size
        num_rows, num_items = self.lengths_KM.shape
        valid_KM = np.arange(num_items) < self.count_K[:, None]
        option_KM = np.where(valid_KM, self.all_split_option, -1)
        tokens_KR = np.repeat((self.reserve_KM.sum(axis=1) // cp_size)[:, None], cp_size, axis=1)
        # the cost table of all ranks: each item's slot is its TE slot (invalid positions cost 0)
        cost_KMJ = self.cost_per_rank[self.sizes_desc.index(cp_size)]
        cost_KR = np.broadcast_to(cost_KMJ.sum(axis=1), (num_rows, cp_size)).copy()
        if self.calls is None:
            return option_KM, tokens_KR, cost_KR
        called_K1 = (self.count_K > 0)[:, None]  # one call of all ranks per row with items
        split = self.all_split_option
        device_KR = cost_KR + called_K1 * self.open_device_O[split]
        return option_KM, tokens_KR, self._combined(device_KR, called_K1 * self.open_host_O[split])
