"""PackingStats: what a plan costs and what every policy removed, as numbers and a table."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import numpy as np

from thdpack.layout.rules import cp_multiple
from thdpack.plan.overflow import OVERFLOW_COUNTS

FULLNESS_PERCENTILES: tuple[int, ...] = (0, 1, 5, 25, 50, 75, 95, 100)


@dataclass(frozen=True, kw_only=True)
class PackingStats:
    """Counts of a packing plan. Tokens are real tokens unless the name says otherwise."""

    algorithm: str
    """Planner that made the plan."""
    pack_size: int
    """Tokens per pack."""
    cp_size: int
    """Context-parallel size the slots were rounded for (each sequence a multiple of 2*cp_size; under
    an adaptive CP placement, a whole sequence takes its length and a split one a multiple of 2*g)."""
    num_packs: int
    """Packs in the plan."""
    num_sequences: int
    """Input sequences that were placed (whole, truncated or split)."""
    num_entries: int
    """Placed pieces: equals num_sequences unless overflow='split' cut sequences."""
    real_tokens: int
    """Tokens of the placed pieces (after truncation)."""
    cp_padding_tokens: int
    """Padding inside the slots: every piece rounded to a multiple of 2*cp_size (2*g for a piece
    split over a group of g ranks, none for one placed whole)."""
    capacity_tokens: int
    """num_packs * pack_size."""
    lower_bound_packs: int
    """Martello–Toth L2 lower bound on the packs any planner needs for these slots."""
    best_lower_bound_packs: int = 0
    """The strongest lower bound thdpack computes (``thdpack.plan.bounds``: L2, single fills,
    the CCM dual feasible function), >= lower_bound_packs; a plan that reaches it is optimal."""
    fit_packs: int | None = None
    """Packs of the decreasing fit (bfd / ffd) before the improvement phase, when the phase saved
    some; None otherwise."""
    dropped_sequences: int = 0
    """Sequences removed by overflow='drop'."""
    dropped_tokens: int = 0
    """Tokens of the dropped sequences."""
    truncated_sequences: int = 0
    """Sequences cut to pack_size by overflow='truncate'."""
    truncated_tokens: int = 0
    """Tokens cut off by overflow='truncate'."""
    split_sequences: int = 0
    """Sequences cut into several pieces by overflow='split' (no token is lost)."""
    max_sequences_per_pack: int = 0
    """Most pieces in one pack (the longest cu_seqlens a batch row needs, minus one)."""
    fullness_percentiles: dict[int, float] = field(default_factory=dict)
    """Percentile -> real tokens / pack_size of the packs at that percentile."""

    @property
    def efficiency(self) -> float:
        """real_tokens / capacity_tokens."""
        return self.real_tokens / self.capacity_tokens if self.capacity_tokens else 0.0

    @property
    def tail_padding_tokens(self) -> int:
        """Padding at the end of packs (capacity minus real tokens minus CP padding)."""
        return self.capacity_tokens - self.real_tokens - self.cp_padding_tokens

    @property
    def packs_over_lower_bound(self) -> float:
        """num_packs / lower_bound_packs (1.0 is provably optimal)."""
        return self.num_packs / self.lower_bound_packs if self.lower_bound_packs else 1.0

    @property
    def gap_packs(self) -> int:
        """num_packs - lower_bound_packs: packs over L2 (at most this many could be saved)."""
        return self.num_packs - self.lower_bound_packs

    @property
    def optimal(self) -> bool:
        """True when num_packs reaches best_lower_bound_packs: no plan has fewer packs."""
        return self.num_packs <= max(self.best_lower_bound_packs, self.lower_bound_packs)

    def removed(self) -> str:
        """What the overflow policy did to the data, in words ("no token lost" only when none was).

        >>> PackingStats(algorithm="bfd", pack_size=8, cp_size=1, num_packs=1, num_sequences=2, num_entries=2,
        ...     real_tokens=7, cp_padding_tokens=0, capacity_tokens=8, lower_bound_packs=1,
        ...     dropped_sequences=1, dropped_tokens=9).removed()
        '1 sequences over pack_size=8 dropped (9 tokens, 56.2% of the tokens): not trained on'
        """
        over = f"sequences over pack_size={self.pack_size:,}"
        if self.dropped_sequences:
            share = _share(self.dropped_tokens, self.real_tokens + self.dropped_tokens)
            return (
                f"{self.dropped_sequences:,} {over} dropped ({self.dropped_tokens:,} tokens, {share}): not trained on"
            )
        if self.truncated_sequences:
            share = _share(self.truncated_tokens, self.real_tokens + self.truncated_tokens)
            return (
                f"{self.truncated_sequences:,} {over} truncated, {self.truncated_tokens:,} tokens cut ({share}): "
                "not trained on"
            )
        if self.split_sequences:
            return f"{self.split_sequences:,} {over} split into pieces, no token lost"
        return "no token lost"

    def to_dict(self) -> dict:
        """Plain JSON-ready dict, derived numbers included."""
        out = asdict(self)
        out["fullness_percentiles"] = {str(k): v for k, v in self.fullness_percentiles.items()}
        out.update(
            efficiency=self.efficiency,
            tail_padding_tokens=self.tail_padding_tokens,
            packs_over_lower_bound=self.packs_over_lower_bound,
            gap_packs=self.gap_packs,
            optimal=self.optimal,
        )
        return out

    def __str__(self) -> str:
        notes = ["optimal"] if self.optimal else []
        if self.fit_packs:
            notes.append(f"{self.algorithm} alone: {self.fit_packs:,}")
        rows = [
            ("algorithm", self.algorithm),
            ("pack_size / cp_size", f"{self.pack_size:,} / {self.cp_size}"),
            ("packs", f"{self.num_packs:,}" + (f"  ({'; '.join(notes)})" if notes else "")),
            (
                "lower bound (L2)",
                f"{self.lower_bound_packs:,}  (packs / bound = {self.packs_over_lower_bound:.5f}, "
                f"{self.gap_packs:,} over)",
            ),
            ("best lower bound", f"{max(self.best_lower_bound_packs, self.lower_bound_packs):,}"),
            (
                "sequences placed",
                f"{self.num_sequences:,}"
                + (f"  ({self.num_entries:,} pieces)" if self.num_entries != self.num_sequences else ""),
            ),
            ("real tokens", f"{self.real_tokens:,}"),
            ("efficiency", f"{100 * self.efficiency:.3f}%"),
            ("cp padding tokens", f"{self.cp_padding_tokens:,}"),
            ("tail padding tokens", f"{self.tail_padding_tokens:,}"),
            ("max sequences / pack", f"{self.max_sequences_per_pack:,}"),
        ]
        if self.dropped_sequences:
            rows.append(
                (
                    "dropped (overflow)",
                    f"{self.dropped_sequences:,} sequences, {self.dropped_tokens:,} tokens",
                )
            )
        if self.truncated_sequences:
            rows.append(
                (
                    "truncated (overflow)",
                    f"{self.truncated_sequences:,} sequences, {self.truncated_tokens:,} tokens cut",
                )
            )
        if self.split_sequences:
            rows.append(("split (overflow)", f"{self.split_sequences:,} sequences, no token lost"))
        if self.fullness_percentiles:
            cells = "  ".join(f"p{p}={100 * v:.1f}%" for p, v in self.fullness_percentiles.items())
            rows.append(("pack fullness", cells))
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}% of the tokens" if whole else "all of the tokens"


def weighted_percentiles(values: np.ndarray, weights: np.ndarray | None = None) -> dict[int, float]:
    """Percentiles (FULLNESS_PERCENTILES) of ``values`` repeated ``weights`` times: the smallest
    value whose cumulative weight reaches the percentile (p0 = min, p100 = max).

    >>> weighted_percentiles(np.array([0.5, 1.0]), np.array([1, 3]))[25]
    0.5
    >>> weighted_percentiles(np.array([0.5, 1.0]), np.array([1, 3]))[50]
    1.0
    """
    values = np.asarray(values, dtype=np.float64)
    weights = np.ones(len(values), dtype=np.int64) if weights is None else np.asarray(weights)
    if len(values) == 0:
        return {}
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    total = cum[-1]
    out = {}
    for p in FULLNESS_PERCENTILES:
        k = int(np.searchsorted(cum, max(1, -(-p * total // 100)), side="left"))
        out[p] = float(values[order[min(k, len(order) - 1)]])
    return out


def build_stats(
    *,
    algorithm: str,
    pack_size: int,
    cp_size: int,
    num_packs: int,
    num_sequences: int,
    num_entries: int,
    real_tokens: int,
    slot_sizes: np.ndarray,
    slot_counts: np.ndarray,
    pack_loads: tuple[np.ndarray, np.ndarray],
    max_sequences_per_pack: int,
    overflow: Mapping[str, int],
    fit_packs: int | None = None,
) -> PackingStats:
    """The stats of a plan from its totals and histograms: what ``plan_packs`` and the streaming
    packer both report (one place derives the padding, the capacity, the L2 bound, the percentiles).

    ``slot_sizes`` / ``slot_counts``: the distinct slot sizes of the placed entries, in units of
    ``2*cp_size``, and how many entries have each (no array is sized by the pack);
    ``pack_loads``: (values, weights), real tokens of the packs and how many packs have each;
    ``overflow``: the ``OVERFLOW_COUNTS`` of the policy that placed the entries; ``fit_packs``:
    the decreasing fit's packs when the improvement phase saved some.
    """
    from thdpack.plan.bounds import best_lower_bound_of_sizes, l2_lower_bound_of_sizes

    multiple = cp_multiple(cp_size)
    slot_sizes, slot_counts = np.asarray(slot_sizes, dtype=np.int64), np.asarray(slot_counts, dtype=np.int64)
    loads, weights = pack_loads
    capacity = pack_size // multiple
    l2 = l2_lower_bound_of_sizes(slot_sizes, slot_counts, capacity) if num_packs else 0
    # the stronger bounds only matter (and are only computed) when the plan is above L2
    best = best_lower_bound_of_sizes(slot_sizes, slot_counts, capacity) if num_packs > l2 else l2
    return PackingStats(
        algorithm=algorithm,
        pack_size=pack_size,
        cp_size=cp_size,
        num_packs=num_packs,
        num_sequences=num_sequences,
        num_entries=num_entries,
        real_tokens=real_tokens,
        cp_padding_tokens=int((slot_sizes * slot_counts).sum()) * multiple - real_tokens,
        capacity_tokens=num_packs * pack_size,
        lower_bound_packs=l2,
        best_lower_bound_packs=best,
        fit_packs=fit_packs,
        max_sequences_per_pack=max_sequences_per_pack,
        fullness_percentiles=weighted_percentiles(np.asarray(loads, dtype=np.float64) / pack_size, weights),
        **{key: int(overflow.get(key, 0)) for key in OVERFLOW_COUNTS},
    )
