"""PackingStats: derived numbers, the readable table, and percentiles."""

from __future__ import annotations

import numpy as np

from thdpack.plan import plan_packs
from thdpack.plan.packing_stats import weighted_percentiles


def test_table_names_every_number():
    stats = plan_packs([5, 3, 6, 2, 4, 20], 16, cp_size=2, overflow="split").stats
    text = str(stats)
    for label in (
        "algorithm",
        "packs",
        "lower bound (L2)",
        "efficiency",
        "cp padding tokens",
        "tail padding tokens",
        "split (overflow)",
        "pack fullness",
    ):
        assert label in text
    assert f"{100 * stats.efficiency:.3f}%" in text
    assert stats.real_tokens + stats.cp_padding_tokens + stats.tail_padding_tokens == stats.capacity_tokens


def test_fullness_percentiles_match_the_packs():
    lengths = np.random.default_rng(0).integers(1, 300, 3000)
    plan = plan_packs(lengths, 512)  # cp_size 1: fullness comes from the pack templates
    per_pack = np.sort([lengths[p].sum() / 512 for p in plan])
    pct = plan.stats.fullness_percentiles
    assert pct[0] == per_pack[0] and pct[100] == per_pack[-1]
    assert pct[50] == per_pack[int(np.ceil(0.5 * len(per_pack))) - 1]
    cp_plan = plan_packs(lengths, 512, cp_size=2)  # cp_size 2: from the items
    per_pack = np.sort([lengths[p].sum() / 512 for p in cp_plan])
    assert cp_plan.stats.fullness_percentiles[0] == per_pack[0]


def test_weighted_percentiles_written_out():
    pct = weighted_percentiles(np.array([0.25, 0.5, 1.0]), np.array([1, 1, 2]))
    assert (pct[0], pct[25], pct[50], pct[75], pct[100]) == (0.25, 0.25, 0.5, 1.0, 1.0)
    assert weighted_percentiles(np.array([])) == {}


def test_to_dict_is_json_ready():
    import json

    d = plan_packs([5, 3, 6], 10).stats.to_dict()
    assert json.loads(json.dumps(d))["efficiency"] == d["efficiency"]
