"""thdpack.data.prepared_plan: the plan `thdpack prepare` writes is the trainer's epoch 0 when the
settings match; otherwise the note names every setting that differs; damage names the file."""

from __future__ import annotations

import numpy as np
import pytest

from thdpack.data.encode import TokenizedSample
from thdpack.data.manifest import StoreError, read_manifest, write_manifest
from thdpack.data.prepared_plan import PLAN_FILE, read_prepared_plan, write_prepared_plan
from thdpack.data.store import TokenStore, TokenStoreWriter
from thdpack.data.tokenizer import load_tokenizer
from thdpack.packing.dataset import PackedDatasetConfig
from thdpack.packing.runtime import PackingRuntime
from thdpack.plan import PlanConfig

LENGTHS = [5, 17, 3, 30, 9, 12, 2, 25, 8, 14]


@pytest.fixture
def store(tmp_path) -> TokenStore:
    with TokenStoreWriter(tmp_path / "store", tokenizer=load_tokenizer("gpt2")) as writer:
        for i, n in enumerate(LENGTHS):
            writer.add(TokenizedSample(np.arange(1, n + 2) + i, np.ones(n + 1, dtype=bool)))
    return TokenStore(tmp_path / "store")


def test_matching_settings_give_the_trainers_epoch_0(store):
    config = PlanConfig(pack_size=32, algorithm="bfd", overflow="split", seed=7)
    written = write_prepared_plan(store.path, store.lengths, config, cp_size=2)
    prepared = read_prepared_plan(store.path, read_manifest(store.path), config, cp_size=2)
    assert prepared.plan is not None and "epoch 0 trains on" in prepared.note
    assert [p.tolist() for p in prepared.plan] == [p.tolist() for p in written]
    cp2 = PackingRuntime(cp_size=2)
    dataset = PackedDatasetConfig(plan=config).build(store, cp2, lengths=store.lengths, first_plan=prepared.plan)
    replanned = PackedDatasetConfig(plan=config).build(store, cp2, lengths=store.lengths)
    assert dataset.plans_made == 0 and replanned.plans_made == 1
    assert [p.tolist() for p in dataset.plan] == [p.tolist() for p in replanned.plan]


def test_differing_settings_are_named_with_both_values(store):
    write_prepared_plan(store.path, store.lengths, PlanConfig(pack_size=32, seed=0), cp_size=1)
    run = PlanConfig(pack_size=64, algorithm="window", seed=0)
    prepared = read_prepared_plan(store.path, read_manifest(store.path), run, cp_size=2)
    assert prepared.plan is None
    assert "pack_size: store 32, run 64; algorithm: store 'bfd', run 'window'; cp_size: store 1, run 2" in prepared.note
    assert prepared.note.endswith("the run plans epoch 0")


def test_a_damaged_plan_file_is_an_error_naming_it(store):
    config = PlanConfig(pack_size=32)
    write_prepared_plan(store.path, store.lengths, config, cp_size=1)
    (store.path / PLAN_FILE).write_bytes((store.path / PLAN_FILE).read_bytes()[:-3])
    with pytest.raises(StoreError, match=rf"{PLAN_FILE} has \d+ bytes, manifest.json says \d+"):
        read_prepared_plan(store.path, read_manifest(store.path), config, cp_size=1)


def test_a_store_without_a_usable_plan_is_planned_by_the_run(store):
    config = PlanConfig(pack_size=32)
    assert "holds no plan" in read_prepared_plan(store.path, read_manifest(store.path), config, cp_size=1).note
    manifest = read_manifest(store.path)
    manifest["plan"] = {"file": PLAN_FILE, "pack_size": 32, "cp_size": 1}  # what older versions recorded
    write_manifest(store.path, manifest)
    prepared = read_prepared_plan(store.path, read_manifest(store.path), config, cp_size=1)
    assert prepared.plan is None and "without its settings and checksum" in prepared.note
