"""`thdpack stats`: the embedded example, lengths files, and clean errors."""

from __future__ import annotations

import json

import numpy as np

from thdpack.cli import main


def test_embedded_example(capsys, tmp_path):
    argv = ["stats", "--algorithm", "bfd", "sequential", "--json", str(tmp_path / "rows.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "skipped 28 empty sequences (length 0)" in out
    assert "| 4,096 | bfd |" in out and "| 4,096 | sequential |" in out
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["algorithm"] for r in rows] == ["bfd", "sequential"]
    assert rows[0]["efficiency"] > 0.999 > rows[1]["efficiency"]


def test_lengths_files(capsys, tmp_path):
    np.save(tmp_path / "l.npy", np.array([100, 200, 300]))
    (tmp_path / "l.txt").write_text("100\n200\n300\n")
    for name in ("l.npy", "l.txt"):
        assert main(["stats", str(tmp_path / name), "--pack-size", "512", "1024", "--cp-size", "2"]) == 0
        assert "| 1,024 | window |" in capsys.readouterr().out


def test_stats_alone_plans_the_embedded_example_as_the_trainer(capsys):
    """``thdpack stats`` with no INPUT, the first command a newcomer types, plans the embedded
    example with the trainer's overflow='split' (some stdlib files are longer than a pack) and says
    so; it stopped with an overflow error. ``--overflow error`` still stops, naming the sequence."""
    assert main(["stats", "--algorithm", "bfd"]) == 0
    out = capsys.readouterr().out
    assert "overflow: split (the trainer's, for the embedded example" in out
    assert "| 4,096 | bfd |" in out
    assert main(["stats", "--algorithm", "bfd", "--overflow", "error"]) == 2
    assert "sequence 4 has 13283 tokens, over pack_size=4096 (772 sequences in total)" in capsys.readouterr().err


def test_stats_of_an_input_defaults_overflow_as_the_plan_config(capsys, tmp_path):
    """An INPUT is planned with ``PlanConfig``'s defaults: overflow='error' unless told."""
    np.save(tmp_path / "l.npy", np.array([100, 5000, 300]))
    assert main(["stats", str(tmp_path / "l.npy"), "--algorithm", "bfd"]) == 2
    assert "sequence 1 has 5000 tokens, over pack_size=4096" in capsys.readouterr().err
    assert main(["stats", str(tmp_path / "l.npy"), "--algorithm", "bfd", "--overflow", "split"]) == 0
    assert "overflow:" not in capsys.readouterr().out


def test_stats_says_which_cp_placement_it_assumed(capsys, tmp_path):
    """At cp > 1 ``thdpack stats`` plans the trainer's default placement (adaptive) and says so;
    --cp-placement te plans Transformer Engine's layout, every sequence a multiple of 2*cp slots."""
    lengths = [101, 203, 301, 31, 41, 2001]
    np.save(tmp_path / "l.npy", np.array(lengths))
    argv = ["stats", str(tmp_path / "l.npy"), "--pack-size", "2048", "--cp-size", "2", "--algorithm", "bfd"]
    rows = {}
    for placement in ("adaptive", "te"):
        flag = [] if placement == "adaptive" else ["--cp-placement", "te"]
        assert main([*argv, *flag, "--json", str(tmp_path / f"{placement}.json")]) == 0
        rows[placement] = json.loads((tmp_path / f"{placement}.json").read_text())[0]
        said = {"adaptive": "adaptive (the trainer's default: short", "te": "te (Transformer Engine's layout"}
        assert f"cp placement: {said[placement]}" in capsys.readouterr().out
    assert rows["te"]["cp_padding_tokens"] == sum(-n % 4 for n in lengths)
    assert rows["adaptive"]["cp_padding_tokens"] < rows["te"]["cp_padding_tokens"]  # whole sequences are not padded
    assert main(["stats", str(tmp_path / "l.npy"), "--pack-size", "4096"]) == 0
    assert "cp placement: none (cp_size 1" in capsys.readouterr().out


def test_errors_are_messages_not_tracebacks(capsys, tmp_path):
    assert main(["stats", str(tmp_path / "missing.npy")]) == 2
    assert "thdpack stats: error:" in capsys.readouterr().err
    np.save(tmp_path / "l.npy", np.array([100, 200]))
    assert main(["stats", str(tmp_path / "l.npy"), "--pack-size", "1004", "--cp-size", "4"]) == 2
    assert "pack_size=1004 is not a multiple of 2*cp_size=8" in capsys.readouterr().err


def test_every_command_is_listed_and_loads_its_arguments(capsys):
    import pytest

    from thdpack.cli import COMMANDS, build_parser

    for name in COMMANDS:
        with pytest.raises(SystemExit) as done:
            build_parser(name).parse_args([name, "--help"])
        assert done.value.code == 0
        assert f"usage: thdpack {name}" in capsys.readouterr().out
