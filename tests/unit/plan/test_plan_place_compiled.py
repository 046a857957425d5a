"""The placement search's row-at-a-time loop (``thdpack.plan.place_compiled``) gives exactly the
numpy loop's placements: as plain Python (always), compiled by numba (when installed), and through
whole adaptive plans; for tiles, pairs and the time model (each group's call paid once, device and
host combined as on a GPU, or added as on a CPU)."""

from __future__ import annotations

import numpy as np
import pytest

import thdpack.plan.place as place
from thdpack._optional import has_module
from thdpack.layout.rules import round_up_to_cp
from thdpack.perf.time_cost import TimeCostModel
from thdpack.plan import plan_packs
from thdpack.plan.place import place_rows
from thdpack.plan.place_compiled import search_rows

needs_numba = pytest.mark.skipif(not has_module("numba"), reason="numba is not installed (thdpack[fast])")
COST_MODELS = {
    "tiles": "tiles",
    "pairs": "pairs",
    "time": TimeCostModel.load("h100_sxm", "llama3-8b"),  # host-bound on short rows, device-bound on long ones
    "time_cpu": TimeCostModel.load("cpu_gloo", "megatron-dcp-gpt"),  # host and device add
}


def _random_rows(rng: np.random.Generator, cp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Rows of items costliest first whose TE slots nearly fill ``cp x budget``: tight enough that
    some rows get stuck and are searched again with reserved items."""
    rows, width = int(rng.integers(1, 12)), int(rng.integers(2, 16))  # every row holds an item
    lengths = -np.sort(-rng.integers(1, int(rng.choice([64, 600, 3000])), size=(rows, width)), axis=1)
    count = rng.integers(1, width + 1, size=rows)
    valid = np.arange(width) < count[:, None]
    reserve = np.where(valid, round_up_to_cp(lengths, cp), 0)
    budget = int(reserve.sum(axis=1).max()) // cp
    return lengths, reserve, valid, budget


def _same(cp: int, cost_model: str, seed: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """Place random rows by numpy and by the row loop (compiled, or ``search_rows`` as plain Python
    when ``python``); assert equal results; return how often numpy's loop searched rows again."""
    searches = []
    numpy_run = place._Search.run

    def counted(self, rows_K, tail_K, level_K):
        searches.append(len(rows_K))
        return numpy_run(self, rows_K, tail_K, level_K)

    monkeypatch.setattr(place._Search, "run", counted)
    rng = np.random.default_rng(seed)
    again = 0
    for _ in range(12):
        lengths, reserve, valid, budget = _random_rows(rng, cp)
        density = float(rng.choice([0.0, 0.05, 2.0]))
        kwargs = dict(cp_size=cp, budget=budget, cost_model=COST_MODELS[cost_model], fill_density=density)
        searches.clear()
        by_numpy = place_rows(lengths, reserve, valid, engine="numpy", **kwargs)
        again += len(searches) - 1
        by_rows = place_rows(lengths, reserve, valid, engine="compiled", **kwargs)
        for a, b in zip(by_numpy, by_rows, strict=True):
            np.testing.assert_array_equal(a, b)
    return again


@pytest.mark.parametrize("cp", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("cost_model", list(COST_MODELS))
def test_row_loop_in_python_equals_the_numpy_loop(cp, cost_model, monkeypatch):
    monkeypatch.setattr(place, "compiled_search_rows", lambda: search_rows)
    again = sum(_same(cp, cost_model, seed, monkeypatch) for seed in range(3))
    assert again > 0, "the cases include rows searched again with reserved items"


@needs_numba
@pytest.mark.parametrize("cp", [2, 3, 4, 6, 8, 16])
@pytest.mark.parametrize("cost_model", list(COST_MODELS))
def test_compiled_loop_equals_the_numpy_loop(cp, cost_model, monkeypatch):
    for seed in range(10):
        _same(cp, cost_model, seed, monkeypatch)


@needs_numba
@pytest.mark.parametrize("cp", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("cost_model", ["tiles", "pairs"])
@pytest.mark.parametrize("algorithm", ["bfd", "window"])
def test_adaptive_plans_are_the_same_compiled(cp, cost_model, algorithm, monkeypatch):
    lengths = np.random.default_rng(cp).lognormal(np.log(600), 1.2, 20000).astype(np.int64).clip(1, 16384)
    pack_size = 16384 // (2 * cp) * 2 * cp

    def plan():
        p = plan_packs(lengths, pack_size, cp_size=cp, cp_placement="adaptive", cost_model=cost_model, overflow="split",
                       algorithm=algorithm)  # fmt: skip
        return p.offsets, p.indices, p.placement.group_size, p.placement.group_start

    monkeypatch.setattr(place, "COMPILED_FROM", 1 << 62)  # numpy everywhere
    by_numpy = plan()
    monkeypatch.setattr(place, "COMPILED_FROM", 0)  # compiled everywhere
    for a, b in zip(by_numpy, plan(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_compiled_engine_without_numba_names_the_extra(monkeypatch):
    monkeypatch.setattr(place, "compiled_search_rows", lambda: None)
    one = np.array([[8]])
    with pytest.raises(ImportError, match=r"needs numba, which is not installed; pip install 'thdpack\[fast\]'"):
        place_rows(one, one, one > 0, cp_size=2, budget=8, cost_model="tiles", engine="compiled")
    with pytest.raises(ValueError, match="unknown engine 'gpu'; valid: auto, numpy, compiled"):
        place_rows(one, one, one > 0, cp_size=2, budget=8, cost_model="tiles", engine="gpu")
