"""The run's reports say what packing removed (issue 17, item 3).

Before: "dropped (overflow) 115 sequences, 18,982 tokens", then "packed: 98 rows, ... no token
lost"; the end summary said nothing of it.
"""

from __future__ import annotations

import numpy as np
import pytest

from thdpack.plan.api import plan_packs
from thdpack.train.metrics import padding_comparison, summary

LENGTHS = np.array([100, 300, 50, 700, 120, 90])
STEP = {"step": 1, "loss": 9.0, "tokens": 10, "capacity": 16, "sequences": 2, "step_seconds": 0.1}


@pytest.mark.parametrize(
    ("overflow", "said"),
    [
        ("drop", "2 sequences over pack_size=256 dropped (1,000 tokens, 73.5% of the tokens): not trained on"),
        ("truncate", "2 sequences over pack_size=256 truncated, 488 tokens cut (35.9% of the tokens): not trained on"),
        ("split", "2 sequences over pack_size=256 split into pieces, no token lost"),
    ],
)
def test_what_each_overflow_policy_removed_is_reported(overflow, said):
    stats = plan_packs(LENGTHS, 256, overflow=overflow).stats
    comparison = padding_comparison(LENGTHS, stats)
    assert comparison.endswith(f"; {said}")
    end = summary([STEP], wall_seconds=1.0, stats=stats)
    assert end.splitlines()[-1] == f"packing.overflow, in every epoch: {said}"
    if overflow != "split":
        assert "no token lost" not in comparison + end


def test_nothing_removed_is_no_token_lost():
    stats = plan_packs(LENGTHS[LENGTHS <= 256], 256).stats
    assert padding_comparison(LENGTHS[LENGTHS <= 256], stats).endswith("; no token lost")
    assert summary([STEP], wall_seconds=1.0, stats=stats).endswith("packing.overflow, in every epoch: no token lost")
