"""Choose each sequence's CP group within a pack: greedy, vectorised over many packs at once.

For every pack (a row of the inputs) the items are taken in the order given (costliest first)
and each goes to the group that keeps the pack's busiest rank cheapest, among the groups that
leave room: whole on one rank (``g = 1``) or split over an aligned group of ``g`` ranks. Loads
below the pack's level (every item whole, perfectly balanced: a lower bound of the busiest rank)
count as the level, so an option that stays below it is as good as any other. Ties go to the
option with less total work, then the smaller group (less communication), then the least-loaded
ranks (longest-processing-time order), then the ranks left with the fewest tokens, then the lower
option index. Every row is
then compared with Transformer Engine's layout (all items split over all ranks) and falls back to
it where that is cheaper.

Room: each item reserves a slot (its TE slot, a multiple of ``2*cp_size``), and the reserves of
a row fit its ranks' budgets split over all ranks. The search first places items wherever they
fit; a row where a later item then fits nowhere is searched again keeping, after every item,
room on every rank for the items still to come split over all ranks (``slot / cp_size`` each).
Splitting the current item over all ranks always keeps that invariant, so every row is placed.

Other work may later fill a row's free room (budget minus reserves): with ``fill_density`` (its
cost per token) that work, spread over all ranks, raises the row's level.

The rows are processed together, one item position at a time; rows are sorted by item count so a
step only touches the rows that still have items. Costs are integers, so ties are exact and the
result is deterministic.

Legend: ``K`` rows (packs or pack templates), ``M`` item positions, ``O`` group options,
``R`` ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from thdpack.plan.cp_cost import CostModel, split_cost, whole_cost
from thdpack.plan.placement import group_options

_BIG = np.iinfo(np.int64).max


def _option_tables(
    lengths_KM: np.ndarray, cp_size: int, sizes: Sequence[int], cost_model: CostModel
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(cost_KMC, tokens_KMC, column_OR, size_O)``: what every item costs and holds on a rank of
    each option, as tables gathered per step: ``cost_KMC[k, m, column_OR[o, r]]`` is item
    ``(k, m)``'s cost on rank ``r`` of option ``o`` (``group_options(cp_size, sizes)`` order); the
    last column is 0 (ranks outside the group)."""
    size_O, start_O = group_options(cp_size, sizes)
    ranks_R = np.arange(cp_size)
    columns, tokens, costs = {}, [], []
    width = 0
    for g in sorted(set(size_O.tolist()), reverse=True):
        flat = lengths_KM.reshape(-1)
        if g == 1:
            cost = whole_cost(flat, cost_model)[:, None]
            share = flat
        else:
            slot = -(-flat // (2 * g)) * (2 * g)
            cost = split_cost(flat, slot, g, cost_model)
            share = slot // g
        columns[g] = width
        width += g
        costs.append(cost)
        tokens.append(np.repeat(share[:, None], g, axis=1))
    zero = np.zeros((lengths_KM.size, 1), dtype=np.int64)
    cost_KMC = np.concatenate([*costs, zero], axis=1).reshape(*lengths_KM.shape, width + 1)
    tokens_KMC = np.concatenate([*tokens, zero], axis=1).reshape(*lengths_KM.shape, width + 1)
    inside_OR = (start_O[:, None] <= ranks_R) & (ranks_R < (start_O + size_O)[:, None])
    offset_O = np.array([columns[g] for g in size_O.tolist()])
    column_OR = np.where(inside_OR, offset_O[:, None] + ranks_R - start_O[:, None], width)
    return cost_KMC, tokens_KMC, column_OR, size_O


def _first_min(key_KO: np.ndarray, allowed_KO: np.ndarray) -> np.ndarray:
    """Narrow ``allowed_KO`` to the options whose ``key`` is the row's smallest allowed value."""
    best_K = np.where(allowed_KO, key_KO, _BIG).min(axis=1)
    return allowed_KO & (key_KO == best_K[:, None])


def place_rows(
    lengths_KM: np.ndarray,
    reserve_KM: np.ndarray,
    valid_KM: np.ndarray,
    *,
    cp_size: int,
    budget: int,
    cost_model: CostModel,
    sizes: Sequence[int] | None = None,
    fill_density: float = 0.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Place every row's items; return ``(option_KM, tokens_KR, cost_KR)``.

    Args:
        lengths_KM: (K, M) int64 tokens of each item (a whole item takes exactly this many).
        reserve_KM: (K, M) int64 the slot each item reserves: a multiple of ``2*cp_size``,
            ``>= lengths_KM`` (its TE slot).
        valid_KM: (K, M) bool, which positions hold an item; a row's items come first.
        cp_size: ranks.
        budget: tokens per rank (``pack_size / cp_size``); each row's valid reserves must sum to
            at most ``cp_size * budget``.
        cost_model: what a rank's load counts (``thdpack.plan.cp_cost``).
        sizes: the group sizes to use (default: all allowed; ``cp_size`` is always used).
        fill_density: cost per token of the work that will fill each row's free room
            (``cp_size * budget`` minus the row's reserves) after this placement.

    Returns:
        option_KM: (K, M) int64 index into ``group_options(cp_size, sizes)``; -1 where invalid.
        tokens_KR: (K, R) int64 tokens each rank holds.
        cost_KR: (K, R) int64 each rank's cost.

    >>> opt, tok, cost = place_rows(np.array([[200, 100, 100, 50]]), np.array([[200, 104, 104, 56]]),
    ...                             np.ones((1, 4), bool), cp_size=4, budget=128, cost_model="tiles")
    >>> group_options(4)[0][opt[0]].tolist()   # 200 on ranks 0-1, the 100s whole on 2 and 3, 50 on 2-3
    [2, 1, 1, 2]
    >>> tok.tolist(), cost.tolist()
    ([[100, 100, 126, 126]], [[2, 2, 3, 3]])
    """
    sizes = tuple(sorted({*(sizes or group_options(cp_size)[0].tolist()), cp_size}))
    lengths_KM = np.asarray(lengths_KM, dtype=np.int64)
    reserve_KM = np.asarray(reserve_KM, dtype=np.int64)
    valid_KM = np.asarray(valid_KM, dtype=bool)
    num_rows, num_items = lengths_KM.shape
    # rows with more items first: at item position m only a prefix of the rows is active
    count_K = valid_KM.sum(axis=1)
    order_K = np.argsort(-count_K, kind="stable")
    search = _Search(
        lengths_KM[order_K], reserve_KM[order_K], count_K[order_K], cp_size, budget, cost_model, sizes, fill_density
    )
    rows = np.arange(num_rows)
    import os

    f = float(os.environ.get("TAILF", "0"))
    share = np.where(np.arange(num_items) < count_K[order_K][:, None], reserve_KM[order_K], 0) // cp_size
    suffix = np.cumsum(share[:, ::-1], axis=1)[:, ::-1]
    tail0 = (suffix > f * budget).sum(axis=1) if f > 0 else np.full(num_rows, num_items)
    option_KM, tokens_KR, cost_KR, stuck_K = search.run(rows, tail0)
    back_off = 1
    while (stuck_K >= 0).any():
        # a later item found no room: the row again, keeping room for the items from a little
        # before the one that was stuck (split over all ranks); the reserved tail grows each round
        rows = rows[stuck_K >= 0]
        tail_K = np.maximum(stuck_K[stuck_K >= 0] - back_off, 0)
        option_KM[rows], tokens_KR[rows], cost_KR[rows], stuck_K = search.run(rows, tail_K)
        back_off *= int(os.environ.get("BACKF", "2"))
    # never worse than TE's layout of the same items, above the level (ties keep the search's: less
    # work, less communication)
    te_option_KM, te_tokens_KR, te_cost_KR = search.all_split()
    # with work to fill the free room, every rank ends at least at the level: below it, TE's
    # layout is no better (the caller checks the filled packs)
    level_K = search.level(np.arange(num_rows)) if fill_density > 0 else np.zeros(num_rows, np.int64)
    worse_K = np.maximum(cost_KR.max(axis=1), level_K) > np.maximum(te_cost_KR.max(axis=1), level_K)
    option_KM[worse_K], tokens_KR[worse_K], cost_KR[worse_K] = (
        te_option_KM[worse_K],
        te_tokens_KR[worse_K],
        te_cost_KR[worse_K],
    )
    back_K = np.empty_like(order_K)
    back_K[order_K] = np.arange(num_rows)
    return option_KM[back_K], tokens_KR[back_K], cost_KR[back_K]


class _Search:
    """The greedy over rows sorted by item count (descending), run on any subset of them."""

    def __init__(
        self,
        lengths_KM: np.ndarray,
        reserve_KM: np.ndarray,
        count_K: np.ndarray,
        cp_size: int,
        budget: int,
        cost_model: CostModel,
        sizes: tuple[int, ...],
        fill_density: float,
    ) -> None:
        self.lengths_KM, self.reserve_KM, self.count_K = lengths_KM, reserve_KM, count_K
        self.cp_size, self.budget, self.cost_model, self.sizes = cp_size, budget, cost_model, sizes
        self.fill_density = fill_density
        size_O, _ = group_options(cp_size, sizes)
        self.all_split_option = int(np.flatnonzero(size_O == cp_size)[0])

    def run(self, rows_K: np.ndarray, tail_K: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(option_KM, tokens_KR, cost_KR, stuck_K)`` of ``rows_K`` (ascending).

        From item ``tail_K`` on, each row's items are *reserved*: every rank keeps room for all of
        them split over all ranks (``reserve / cp_size`` each). Splitting an item of the tail over
        all ranks keeps that invariant, so a row only gets stuck before its tail, where an item may
        fit nowhere: ``stuck_K`` is that item's position (-1 when the row was placed), and the row
        is finished with its remaining items split over all ranks (the result is then invalid)."""
        cp_size, budget = self.cp_size, self.budget
        num_rows, num_items = len(rows_K), self.lengths_KM.shape[1]
        count_K = self.count_K[rows_K]
        option_KM = np.full((num_rows, num_items), -1, dtype=np.int64)
        tokens_KR = np.zeros((num_rows, cp_size), dtype=np.int64)
        cost_KR = np.zeros((num_rows, cp_size), dtype=np.int64)
        stuck_K = np.full(num_rows, -1, dtype=np.int64)
        valid_KM = np.arange(num_items) < count_K[:, None]
        share_KM = np.where(valid_KM, self.reserve_KM[rows_K], 0) // cp_size
        # room every rank keeps after item m: the reserved items after m (all of the tail before it)
        after_KM = np.cumsum(share_KM[:, ::-1], axis=1)[:, ::-1] - share_KM
        tail_share_K = np.take_along_axis(
            np.concatenate((after_KM + share_KM, np.zeros((num_rows, 1), np.int64)), axis=1), tail_K[:, None], axis=1
        )[:, 0]
        lengths_KM = np.where(valid_KM, self.lengths_KM[rows_K], 0)
        level_K = self.level(rows_K)
        cost_KMC, tokens_KMC, column_OR, g_O = _option_tables(lengths_KM, cp_size, self.sizes, self.cost_model)
        for m in range(num_items):
            k = int(np.searchsorted(-count_K, -m, side="left"))  # rows with more than m items
            if k == 0:
                break
            add_cost_KOR = cost_KMC[:k, m][:, column_OR]
            add_tok_KOR = tokens_KMC[:k, m][:, column_OR]
            in_tail_K = m >= tail_K[:k]
            keep_K = np.where(in_tail_K, after_KM[:k, m], tail_share_K[:k])
            fits_KO = (tokens_KR[:k, None, :] + add_tok_KOR).max(axis=2) + keep_K[:, None] <= budget
            fits_KO &= (stuck_K[:k] < 0)[:, None]
            stuck = ~fits_KO.any(axis=1)
            stuck_K[:k][stuck & (stuck_K[:k] < 0)] = m
            fits_KO[:, self.all_split_option] |= in_tail_K | stuck  # the tail split over all ranks fits
            busiest_KO = np.maximum((cost_KR[:k, None, :] + add_cost_KOR).max(axis=2), level_K[:k, None])
            choice_KO = _first_min(busiest_KO, fits_KO)
            choice_KO = _first_min(add_cost_KOR.sum(axis=2), choice_KO)
            choice_KO = _first_min(np.broadcast_to(g_O, choice_KO.shape), choice_KO)
            lightest_KO = np.where(add_tok_KOR > 0, cost_KR[:k, None, :], -_BIG).max(axis=2)
            choice_KO = _first_min(lightest_KO, choice_KO)
            fullest_KO = np.where(add_tok_KOR > 0, tokens_KR[:k, None, :] + add_tok_KOR, -_BIG).max(axis=2)
            choice_KO = _first_min(fullest_KO, choice_KO)
            chosen_K = np.argmax(choice_KO, axis=1)
            at = np.arange(k)
            option_KM[:k, m] = chosen_K
            tokens_KR[:k] += add_tok_KOR[at, chosen_K]
            cost_KR[:k] += add_cost_KOR[at, chosen_K]
        return option_KM, tokens_KR, cost_KR, stuck_K

    def level(self, rows_K: np.ndarray) -> np.ndarray:
        """(K,) a lower bound of each row's busiest rank: every item whole and the work filling the
        free room, perfectly balanced. Below it, options are equally good and the cheaper, less
        communicating one wins."""
        valid_KM = np.arange(self.lengths_KM.shape[1]) < self.count_K[rows_K][:, None]
        lengths_KM = np.where(valid_KM, self.lengths_KM[rows_K], 0)
        whole_K = np.where(valid_KM, whole_cost(lengths_KM, self.cost_model), 0).sum(axis=1)
        free_K = self.cp_size * self.budget - np.where(valid_KM, self.reserve_KM[rows_K], 0).sum(axis=1)
        return (whole_K + np.floor(self.fill_density * free_K).astype(np.int64)) // self.cp_size

    def all_split(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(option_KM, tokens_KR, cost_KR)`` of TE's layout: every item on all ranks."""
        cp_size = self.cp_size
        num_rows, num_items = self.lengths_KM.shape
        valid_KM = np.arange(num_items) < self.count_K[:, None]
        option_KM = np.where(valid_KM, self.all_split_option, -1)
        share_KM = np.where(valid_KM, self.reserve_KM, 0) // cp_size
        tokens_KR = np.repeat(share_KM.sum(axis=1)[:, None], cp_size, axis=1)
        rows, items = np.nonzero(valid_KM)
        cost_IR = split_cost(self.lengths_KM[rows, items], self.reserve_KM[rows, items], cp_size, self.cost_model)
        cost_KR = np.zeros((num_rows, cp_size), dtype=np.int64)
        np.add.at(cost_KR, rows, cost_IR)
        return option_KM, tokens_KR, cost_KR
