"""The trainer's token store: the data config's bad-record policy and chat template reach it; one builder at a time."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from thdpack.data.encode import TokenizeConfig
from thdpack.data.write_store import write_token_store
from thdpack.files.lock import FolderLock
from thdpack.train.config import DataConfig
from thdpack.train.store_cache import cache_path, open_token_store, store_fingerprint

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


@pytest.fixture
def chats(tmp_path):
    path = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"id": 7, "messages": []}) + "\n")
    return path


def test_on_bad_record_reaches_the_store(chats, tmp_path):
    data = DataConfig(inputs=[str(chats)], cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"chats.jsonl line 2: 'messages' is empty: no messages to train on"):
        open_token_store(data, vocab_size=50257, is_local_main=True, barrier=lambda: None)
    skipping = DataConfig(inputs=[str(chats)], cache_dir=str(tmp_path / "cache"), on_bad_record="skip")
    assert store_fingerprint(skipping) != store_fingerprint(data)
    store = open_token_store(skipping, vocab_size=50257, is_local_main=True, barrier=lambda: None)
    assert len(store) == 1
    assert store.manifest["skipped_records"]["by_reason"] == {"empty_conversation": 1}
    logged = json.loads((store.path / "skipped_records.jsonl").read_text())
    assert (logged["line"], logged["reason"]) == (2, "empty_conversation")


def test_data_config_checks_the_new_options(tmp_path):
    with pytest.raises(ValueError, match=r"data.on_bad_record='drop' is not one of 'fail', 'skip'"):
        DataConfig(on_bad_record="drop")
    with pytest.raises(ValueError, match=r"data.chat_template='chatml' is not one of 'auto', 'tokenizer', 'plain'"):
        DataConfig(chat_template="chatml")


def test_a_changed_tokenizer_folder_changes_the_fingerprint(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text("{}")
    data = DataConfig(tokenizer=str(folder), cache_dir=str(tmp_path / "cache"))
    before = store_fingerprint(data)
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    assert store_fingerprint(data) != before


@pytest.mark.parametrize("preset", ["jsonl", "stdlib"])
def test_the_data_presets_compose_with_the_new_options(preset):
    import hydra
    from omegaconf import OmegaConf

    from thdpack.train.config import Config, register_configs

    register_configs()
    overrides = [f"data={preset}", "data.on_bad_record=skip", "data.chat_template=plain"]
    with hydra.initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = OmegaConf.to_object(hydra.compose("train", overrides=overrides))
    assert isinstance(cfg, Config)
    assert (cfg.data.on_bad_record, cfg.data.chat_template) == ("skip", "plain")
    with hydra.initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        default = OmegaConf.to_object(hydra.compose("train", overrides=[f"data={preset}"]))
    assert (default.data.on_bad_record, default.data.chat_template) == ("fail", "auto")


def test_a_second_builder_waits_for_the_first_and_uses_its_cache(chats, tmp_path, capsys):
    """Machines sharing data.cache_dir: the one that comes second waits for the folder's lock,
    then finds the cache intact and tokenizes nothing."""
    data = DataConfig(inputs=[str(chats)], cache_dir=str(tmp_path / "cache"), on_bad_record="skip")
    path = cache_path(data)
    opened = []
    with FolderLock(path) as lock:  # the first builder, mid-build
        second = threading.Thread(
            target=lambda: opened.append(
                open_token_store(data, vocab_size=50257, is_local_main=True, barrier=lambda: None)
            )
        )
        second.start()
        second.join(timeout=1.0)
        assert second.is_alive() and not opened  # waiting for the lock, not building beside the first
        write_token_store(
            [str(chats)], path, tokenize_config=TokenizeConfig(on_bad_record="skip"), lock=lock, verbose=False
        )
        capsys.readouterr()
    second.join(timeout=60)
    assert len(opened) == 1 and len(opened[0]) == 1
    assert "tokenizing" not in capsys.readouterr().out


def test_a_chat_file_under_the_default_data_group_trains_as_chats(chats, tmp_path):
    """The default group (data=stdlib) set kind=text: a chat file failed with "has no field 'text' ...
    pass on_bad_record='skip'". Its kind is now told from each record, as data=jsonl does."""
    import hydra
    from omegaconf import OmegaConf

    from thdpack.train.config import register_configs

    register_configs()
    overrides = [f"data.inputs=[{chats}]", f"data.cache_dir={tmp_path / 'cache'}", "data.on_bad_record=skip"]
    with hydra.initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        data = OmegaConf.to_object(hydra.compose("train", overrides=overrides)).data
    store = open_token_store(data, vocab_size=50257, is_local_main=True, barrier=lambda: None)
    assert len(store) == 1 and store.manifest["prepare"]["tokenize_report"]["kinds"] == {"chat": 2}
    assert store.manifest["skipped_records"]["by_reason"] == {"empty_conversation": 1}


# -- issue 17 item 7: failed builds leave no folder behind --------------------------------------
def _cache_entries(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in cache_dir.iterdir()) if cache_dir.exists() else []


def test_a_build_that_fails_removes_its_folder(tmp_path):
    """A bad record after 600 good ones (a tokenizer batch already stored): the unfinished folder
    stayed in data.cache_dir."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(600)) + "{bad\n")
    data = DataConfig(inputs=[str(docs)], cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"docs\.jsonl line 601: malformed JSON"):
        open_token_store(data, vocab_size=50257, is_local_main=True, barrier=lambda: None)
    assert _cache_entries(tmp_path / "cache") == []


def test_the_next_build_removes_what_a_killed_build_left(chats, tmp_path):
    """A real build process killed (SIGKILL) mid-build, reading its input from a pipe that never
    ends: its folder and lock file stayed for ever, since a cache of another fingerprint is never
    built again in their place. The next build (other data, same cache_dir) removes them; a folder
    that another process is building now (its lock held) is left alone."""
    import os
    import signal
    import subprocess
    import sys
    import time

    cache = tmp_path / "cache"
    pipe = tmp_path / "endless.jsonl"
    os.mkfifo(pipe)
    killed = cache_path(DataConfig(inputs=[str(pipe)], cache_dir=str(cache)))
    build = (
        "from thdpack.train.config import DataConfig\n"
        "from thdpack.train.store_cache import open_token_store\n"
        f"open_token_store(DataConfig(inputs=[{str(pipe)!r}], cache_dir={str(cache)!r}), vocab_size=50257, "
        "is_local_main=True, barrier=lambda: None)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", build])
    try:
        deadline = time.monotonic() + 120
        while not (killed / "tokens.bin").exists():  # the writer has started; the reader waits on the pipe
            assert child.poll() is None and time.monotonic() < deadline, "the build never started writing"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert _cache_entries(cache) == sorted([f".{killed.name}.lock", killed.name])
    busy = cache / f"{killed.name[:-12]}{'0' * 12}"  # another unfinished cache, its builder alive
    busy.mkdir()
    with FolderLock(busy):
        data = DataConfig(inputs=[str(chats)], cache_dir=str(cache), on_bad_record="skip")
        store = open_token_store(data, vocab_size=50257, is_local_main=True, barrier=lambda: None)
        assert _cache_entries(cache) == sorted([store.path.name, busy.name, f".{busy.name}.lock"])


# -- issue 17 item 5: a model folder's tokenizer must be the store's ----------------------------
def _tokenizer_folder(folder: Path, tokenizer) -> str:
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    tokenizer.save(str(folder / "tokenizer.json"), pretty=False)  # formatted unlike the shipped file
    return str(folder)


def test_a_model_folder_with_another_tokenizer_is_refused_naming_both(chats, tmp_path):
    """The vocabulary sizes were all that was compared: a folder shipping its own tokenizer trained
    on a GPT-2 store whenever its vocabulary was the larger."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from thdpack.data.tokenizer import SHIPPED_TOKENIZERS
    from thdpack.models.config import ModelConfig
    from thdpack.models.hf_causal_lm import HFModelConfig
    from thdpack.train.store_cache import check_model_tokenizer

    store = write_token_store(
        [str(chats)], tmp_path / "store", tokenize_config=TokenizeConfig(on_bad_record="skip"), verbose=False
    )
    assert store.manifest["tokenizer"]["vocab_sha256"] == _gpt2_vocab_digest()
    other = Tokenizer(WordLevel({f"w{i}": i for i in range(60_001)}, unk_token="w0"))
    foreign = _tokenizer_folder(tmp_path / "foreign", other)
    with pytest.raises(ValueError) as caught:
        check_model_tokenizer(HFModelConfig(path=foreign), store)
    assert str(caught.value).startswith(
        f"{store.path} was tokenized with 'gpt2' (50,257 ids, vocabulary sha256 {_gpt2_vocab_digest()[:12]}) "
        f"but model.path={foreign} ships another tokenizer (60,001 ids, vocabulary sha256 "
    )
    assert f"data.tokenizer={foreign}, or thdpack prepare ... --tokenizer {foreign}" in str(caught.value)
    same = _tokenizer_folder(tmp_path / "same", Tokenizer.from_file(str(SHIPPED_TOKENIZERS["gpt2"])))
    assert (tmp_path / "same" / "tokenizer.json").read_bytes() != SHIPPED_TOKENIZERS["gpt2"].read_bytes()
    assert check_model_tokenizer(HFModelConfig(path=same), store) is None  # the same vocabulary, other bytes
    (tmp_path / "bare").mkdir()
    assert check_model_tokenizer(HFModelConfig(path=str(tmp_path / "bare")), store) is None  # ships none
    assert check_model_tokenizer(ModelConfig(), store) is None
    store.manifest["tokenizer"].pop("vocab_sha256")  # a store written before the digest: warned, not passed
    assert "records no vocabulary digest" in check_model_tokenizer(HFModelConfig(path=foreign), store)
    shutil.copy(SHIPPED_TOKENIZERS["gpt2"], tmp_path / "same" / "tokenizer.json")
    assert check_model_tokenizer(HFModelConfig(path=same), store) is None  # its very file


def _gpt2_vocab_digest() -> str:
    from thdpack.data.tokenizer import load_tokenizer

    return load_tokenizer("gpt2").vocab_sha256
