"""``thdpack.train.identity``: what resume compares, and what it lets pass (issue 17, item 1)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from thdpack.train.identity import check_resume_identity

FOLDER = Path("out/checkpoints/step_000002")
MODEL = {"kind": "thdpack", "dim": 32, "n_layers": 1, "path": None, "arch": None}


def identity(tokens: str = "a" * 64, tokenizer: str = "t" * 64, dim: int = 32) -> dict:
    return {
        "data": {"origin": "data.store=S", "files": {"tokens.bin": tokens, "offsets.npy": "o" * 64}},
        "tokenizer": {"name": "gpt2", "sha256": tokenizer, "vocab_size": 50257},
        "model": {**MODEL, "dim": dim},
    }


def test_the_same_run_resumes():
    assert check_resume_identity({"identity": identity()}, identity(), folder=FOLDER, data_changed=False) is False


def test_another_tokenizer_is_refused_unless_data_changed_is_set():
    saved, mine = {"identity": identity()}, identity(tokenizer="u" * 64)
    said = "tokenizer (checkpoint 'gpt2' (sha256 tttttttttttt..., 50257 ids), this run 'gpt2' (sha256 uuuuuuuuuuuu..."
    with pytest.raises(ValueError, match=re.escape(said)):
        check_resume_identity(saved, mine, folder=FOLDER, data_changed=False)
    assert check_resume_identity(saved, mine, folder=FOLDER, data_changed=True) is True


def test_another_model_is_refused_even_with_data_changed():
    with pytest.raises(ValueError, match=re.escape("(dim: checkpoint 32, this run 64)")):
        check_resume_identity({"identity": identity()}, identity(dim=64), folder=FOLDER, data_changed=True)


def test_a_checkpoint_without_an_identity_compares_its_model_only(caplog):
    """Checkpoints of an older thdpack hold their config, not their data's identity."""
    old = {"config": {"model": {**MODEL, "attention": {"backend": "math"}}}}
    with caplog.at_level(logging.WARNING, logger="thdpack.train.identity"):
        assert check_resume_identity(old, identity(tokens="b" * 64), folder=FOLDER, data_changed=False) is False
    assert f"checkpoint {FOLDER} records no data or tokenizer identity (an older thdpack wrote it)" in caplog.text
    with pytest.raises(ValueError, match=re.escape("(dim: checkpoint 32, this run 64)")):
        check_resume_identity(old, identity(dim=64), folder=FOLDER, data_changed=False)
