"""The trainer never trains on a damaged token store (issue 9, item 3).

Its automatic cache rebuilds itself, with a warning naming the damaged file (before: a deleted
``manifest.json`` failed every later run with "run `thdpack prepare` first", a truncated file
said "prepare it again", shuffled tokens trained silently). A store the user names
(``data.store``) is never rebuilt: damage stops the run naming the file (before: out-of-vocabulary
ids crashed in the embedding with ``IndexError: index out of range in self``).

The runs are the real trainer in this process (one rank, gloo) with the overrides of
``test_train.py``, one step each; one damaged cache goes through ``torchrun`` with 2 ranks.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from test_train import losses, torchrun
from test_train_checkpoints import config, truncate

from thdpack.data import StoreError, TokenStore, verify_store
from thdpack.data.prepared_plan import write_prepared_plan
from thdpack.train.store_cache import cache_path
from thdpack.train.trainer import run

pytestmark = pytest.mark.distributed
RUN = ["parallel.cp_size=1", "train.steps=1", "train.checkpoint_every=0"]


def train(out: Path, cache: Path, *overrides: str) -> list[float]:
    run(config(out, cache, *RUN, *overrides))
    return losses(out)


@pytest.fixture(scope="module")
def intact(tmp_path_factory) -> tuple[Path, list[float]]:
    """A cache built by a first run (the folder that holds it) and that run's losses."""
    cache = tmp_path_factory.mktemp("stores")
    return cache, train(tmp_path_factory.mktemp("first"), cache)


@pytest.fixture
def cache(intact, tmp_path) -> Path:
    """A copy of the intact cache folder, for this test to damage."""
    copy = tmp_path / "stores"
    shutil.copytree(intact[0], copy)
    return copy


def shuffle_tokens(store: Path) -> str:
    tokens = np.fromfile(store / "tokens.bin", dtype=np.uint16)
    np.random.default_rng(0).permutation(tokens).tofile(store / "tokens.bin")  # same size, same ids
    return "tokens.bin does not match its sha256 in manifest.json"


def id_over_the_vocabulary(store: Path) -> str:
    tokens = np.memmap(store / "tokens.bin", dtype=np.uint16, mode="r+")
    tokens[1000] = 60000
    tokens.flush()
    return "tokens.bin holds token id 60000 at token 1000 (sample 0), outside [0, 50257) of tokenizer 'gpt2'"


def delete_manifest(store: Path) -> str:
    (store / "manifest.json").unlink()
    return "manifest.json is missing"


def truncate_tokens(store: Path) -> str:
    truncate(store / "tokens.bin")
    return "tokens.bin has 760586 bytes, manifest.json implies 1521172"


def written_before_checksums(store: Path) -> str:
    manifest = json.loads((store / "manifest.json").read_text())
    del manifest["checksums"], manifest["token_ids"]
    (store / "manifest.json").write_text(json.dumps({**manifest, "version": 1}))
    return "manifest.json has no checksums (store version 1"


CACHE_DAMAGE: dict[str, Callable[[Path], str]] = {
    "deleted manifest.json": delete_manifest,
    "truncated tokens.bin": truncate_tokens,
    "shuffled tokens": shuffle_tokens,
    "ids over the vocabulary": id_over_the_vocabulary,
    "written before checksums": written_before_checksums,
}


@pytest.mark.parametrize("case", list(CACHE_DAMAGE))
def test_a_damaged_cache_is_rebuilt_with_a_warning_naming_the_file(intact, cache, tmp_path, caplog, case):
    store = cache_path(config(tmp_path, cache).data)
    said = CACHE_DAMAGE[case](store)
    with caplog.at_level(logging.WARNING, logger="thdpack.train.store_cache"):
        values = train(tmp_path / "out", cache)
    warning = f"token cache {store} is damaged: {store}/{said}"
    assert re.search(re.escape(warning) + r".*; rebuilding it$", caplog.text, re.MULTILINE), caplog.text
    assert "prepare" not in caplog.text  # a cache repairs itself: nothing for the user to prepare
    assert verify_store(store).checksums and values == intact[1]  # the rebuilt cache trains like the first
    assert sorted(p.name for p in cache.iterdir()) == [store.name]  # no temporary or damaged folder left


def test_a_damaged_cache_is_rebuilt_under_torchrun(cache, tmp_path):
    """Two ranks: the local main rank rebuilds while the other waits, then both train."""
    store = cache_path(config(tmp_path, cache).data)
    said = delete_manifest(store)
    result = torchrun(tmp_path / "out", cache, "train.steps=2", "train.checkpoint_every=0")
    assert f"token cache {store} is damaged: {store}/{said}" in result.stderr
    assert len(losses(tmp_path / "out")) == 2 and verify_store(store).checksums


@pytest.fixture
def user_store(intact, tmp_path) -> Path:
    """A store the user prepared (a copy of the cached one: same files as `thdpack prepare` writes)."""
    (store,) = intact[0].iterdir()
    copy = tmp_path / "prepared"
    shutil.copytree(store, copy)
    return copy


def test_a_user_store_is_trained_on_as_it_is(intact, user_store, tmp_path, capsys):
    assert train(tmp_path / "out", tmp_path / "unused", f"data.store={user_store}") == intact[1]
    printed = capsys.readouterr().out
    assert f"verified {user_store}: sha256, offsets and token ids of 60 samples, 760,586 tokens" in printed
    assert f"data: {user_store} -> TokenStore(" in printed
    assert not (tmp_path / "unused").exists()  # no cache was built


@pytest.mark.parametrize("damage", [shuffle_tokens, id_over_the_vocabulary], ids=["shuffled", "ids over vocab"])
def test_a_damaged_user_store_stops_the_run_naming_the_file(user_store, tmp_path, damage):
    said = damage(user_store)
    before = {p.name: p.read_bytes() for p in user_store.iterdir()}
    fix = f"; the store is damaged: write it again with `thdpack prepare ... --out {user_store} --overwrite`"
    with pytest.raises(StoreError, match=re.escape(f"{user_store}/{said}") + ".*" + re.escape(fix)):
        train(tmp_path / "out", tmp_path / "unused", f"data.store={user_store}")
    assert {p.name: p.read_bytes() for p in user_store.iterdir()} == before  # never rebuilt or touched


def test_token_ids_are_checked_against_the_models_vocabulary(user_store, tmp_path):
    message = (
        f"{user_store}/tokens.bin holds token id 37811 at token 0 (sample 0), outside the model's vocabulary "
        "(vocab_size=1000); the store was tokenized by 'gpt2' with 50257 ids: give the model vocab_size >= 50257"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        train(tmp_path / "out", tmp_path / "unused", f"data.store={user_store}", "model.vocab_size=1000")


def test_a_prepared_plan_trains_epoch_0_when_the_settings_match(intact, user_store, tmp_path, capsys):
    """The plan `thdpack prepare` records is the trainer's own epoch 0: same losses, no re-planning;
    a run with another setting says which one and plans itself."""
    cfg = config(tmp_path / "unused_out", tmp_path / "unused", *RUN, f"data.store={user_store}")
    write_prepared_plan(user_store, TokenStore(user_store).lengths, cfg.packing_config.plan, cp_size=1)
    assert train(tmp_path / "out", tmp_path / "unused", f"data.store={user_store}") == intact[1]
    assert f"epoch 0 trains on {user_store / 'plan.npz'}" in capsys.readouterr().out
    train(tmp_path / "other", tmp_path / "unused", f"data.store={user_store}", "packing.seed=1")
    note = f"{user_store / 'plan.npz'} was planned with other settings (seed: store 0, run 1): the run plans epoch 0"
    assert note in capsys.readouterr().out
