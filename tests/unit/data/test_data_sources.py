"""Sources: every format on small files, format detection, counted skips, errors naming the place."""

from __future__ import annotations

import gzip
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from thdpack.data import _json_array
from thdpack.data.sources import Source, SourceConfig, detect_format, stdlib_root


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_jsonl_records_with_counted_skips(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ['{"text": "a"}', "", '{"text": "  "}', '{"text": "b", "id": 3}'])
    src = Source(path)
    assert src.format == "jsonl"
    assert list(src.records_with_origin()) == [
        (f"{path} line 1", {"text": "a"}),
        (f"{path} line 4", {"text": "b", "id": 3}),
    ]
    assert (src.report.records, src.report.skipped_empty, src.report.blank_lines) == (2, 1, 1)
    assert list(src) == [{"text": "a"}, {"text": "b", "id": 3}]  # re-iterable; the report restarts
    assert src.report.records == 2


def test_jsonl_gzip_and_json_with_objects_per_line(tmp_path):
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write('{"text": "zipped"}\n')
    assert list(Source(tmp_path / "d.jsonl.gz")) == [{"text": "zipped"}]
    write_jsonl(tmp_path / "lines.json", ['{"text": "x"}', '{"text": "y"}'])
    assert detect_format(tmp_path / "lines.json") == "jsonl"
    assert [r["text"] for r in Source(tmp_path / "lines.json")] == ["x", "y"]


def test_byte_order_marks_are_dropped(tmp_path):
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "a"}\n')
    (tmp_path / "bom.json").write_bytes(b'\xef\xbb\xbf[{"text": "b"}]')
    assert list(Source(tmp_path / "bom.jsonl")) == [{"text": "a"}]
    assert list(Source(tmp_path / "bom.json")) == [{"text": "b"}]


def test_jsonl_errors_name_file_and_line(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", ['{"text": "a"}', '{"text": "b"', "[1, 2]"])
    with pytest.raises(ValueError, match=r"bad.jsonl line 2: malformed JSON: Expecting ',' delimiter"):
        list(Source(bad))
    arr = write_jsonl(tmp_path / "arr.jsonl", ["[1, 2]"])
    with pytest.raises(ValueError, match=r"arr.jsonl line 1: expected a JSON object \(a mapping\), got list"):
        list(Source(arr))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin.jsonl line 2: not valid UTF-8 .* decode_errors='replace'"):
        list(Source(latin))
    src = Source(latin, SourceConfig(decode_errors="replace"))
    assert list(src)[1] == {"text": "caf\ufffd"}
    assert src.report.decode_replaced == 1


def test_json_array_streams_records(tmp_path):
    records = [{"instruction": "i", "input": "", "output": "o"}, {"text": "é ✓"}, {"text": ""}]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(records, indent=4))
    src = Source(path)
    assert src.format == "json"
    assert list(src) == records[:2]
    assert src.report.skipped_empty == 1
    origins = [o for o, _ in src.records_with_origin()]
    assert origins == [f"{path} record 0 (line 2)", f"{path} record 1 (line 7)"]
    (tmp_path / "empty.json").write_text(" [ ] ")
    assert list(Source(tmp_path / "empty.json")) == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"text": "a"}', r"expected a JSON array of records starting with '\[', found '\{'"),
        ("", "found an empty file"),
        ('[{"text": "a"},\n {"text": }]', r"record 1 \(line 2\): malformed JSON: Expecting value"),
        ('[{"text": "a"} {"text": "b"}]', r"line 1: expected ',' or '\]' after record 0, found '\{'"),
        ('[{"text": "a"},', r"the JSON array is not closed"),
        ('[{"text": "a"}] x', r"unexpected 'x' after the closing '\]'"),
    ],
)
def test_json_array_errors(tmp_path, text, message):
    path = tmp_path / "d.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        list(Source(path, SourceConfig(format="json")))


@given(
    records=st.lists(
        st.dictionaries(st.sampled_from(["text", "a", "ü"]), st.text(min_size=1) | st.integers(), min_size=1),
        max_size=8,
    ),
    chunk=st.integers(1, 9),
    indent=st.sampled_from([None, 1]),
)
def test_json_array_stream_equals_json_load_for_any_window(tmp_path_factory, records, chunk, indent):
    path = tmp_path_factory.mktemp("j") / "d.json"
    path.write_text(json.dumps(records, indent=indent, ensure_ascii=False), encoding="utf-8")
    original = _json_array._CHUNK_CHARS
    _json_array._CHUNK_CHARS = chunk  # tiny read windows cut records, strings and UTF-8 sequences
    try:
        with open(path, "rb") as f:
            streamed = [r for _, _, r in _json_array.iter_json_array(f, str(path))]
    finally:
        _json_array._CHUNK_CHARS = original
    assert streamed == records


def test_text_folder_walk_order_hidden_and_suffixes(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / ".git").mkdir()
    for name, text in {
        "z.txt": "top z",
        "y.md": "top y",
        "a/inner.txt": "in a",
        "b/inner.txt": "in b",
        "b/empty.txt": "\n\n",
        ".hidden.txt": "hidden",
        ".git/config": "hidden too",
    }.items():
        (tmp_path / name).write_text(text)
    src = Source(tmp_path)
    assert src.format == "text"
    # os.walk order with sorted names: a folder's files first, then its sub-folders
    assert [r["path"] for r in src] == ["y.md", "z.txt", "a/inner.txt", "b/inner.txt"]
    assert src.report.skipped_empty == 1
    only_txt = Source(tmp_path, SourceConfig(text_suffixes=(".txt",)))
    assert [r["path"] for r in only_txt] == ["z.txt", "a/inner.txt", "b/inner.txt"]
    assert list(Source(tmp_path / "y.md")) == [{"text": "top y", "path": "y.md"}]


def test_text_folder_undecodable_file(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"ok \xff\xfe")
    with pytest.raises(ValueError, match=r"bad.txt: not valid UTF-8 \(invalid start byte at byte 3\)"):
        list(Source(tmp_path))
    src = Source(tmp_path, SourceConfig(decode_errors="replace"))
    assert list(src) == [{"text": "ok \ufffd\ufffd", "path": "bad.txt"}]
    assert src.report.decode_replaced == 1


def test_stdlib_is_the_interpreters_sorted_py_files():
    src = Source("stdlib")
    assert src.format == "stdlib" and src.path == stdlib_root()
    paths = [r["path"] for r in src]
    assert paths[:2] == ["__future__.py", "__hello__.py"]
    assert all(p.endswith(".py") and "site-packages" not in p for p in paths)
    on_disk = [p for p in stdlib_root().rglob("*.py") if "site-packages" not in p.parts]
    assert src.report.records + src.report.skipped_empty == len(on_disk)
    assert src.report.records == len(paths) and src.report.skipped_empty > 0  # e.g. empty __init__.py files
    assert src.describe()["format"] == "stdlib"


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", "", "c"], "n": [1, None, 3]}), tmp_path / "d.parquet")
    src = Source(tmp_path / "d.parquet")
    assert src.format == "parquet"
    assert list(src.records_with_origin()) == [
        (f"{tmp_path / 'd.parquet'} row 0", {"text": "a", "n": 1}),
        (f"{tmp_path / 'd.parquet'} row 2", {"text": "c", "n": 3}),
    ]
    assert src.report.skipped_empty == 1
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"junk\.parquet: not a readable parquet file"):
        list(Source(tmp_path / "junk.parquet"))


def test_hf_save_to_disk_folder(tmp_path):
    import datasets

    rows = {"instruction": ["i0", "i1"], "input": ["", "x"], "output": ["o0", "o1"]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "one"))
    src = Source(tmp_path / "one")
    assert src.format == "hf"
    assert list(src) == [
        {"instruction": "i0", "input": "", "output": "o0"},
        {"instruction": "i1", "input": "x", "output": "o1"},
    ]
    both = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows), "test": datasets.Dataset.from_dict(rows)})
    both.save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match=r"holds the splits \['train', 'test'\]; pass split="):
        list(Source(tmp_path / "dict"))
    assert len(list(Source(tmp_path / "dict", SourceConfig(split="test")))) == 2


def test_format_detection_and_config_errors(tmp_path):
    assert detect_format("stdlib") == "stdlib"
    with pytest.raises(FileNotFoundError, match=r"input '.*missing.jsonl' does not exist"):
        Source(tmp_path / "missing.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"cannot tell the format of '.*d.csv' from its name; pass format="):
        Source(tmp_path / "d.csv")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "dataset_info.json").write_text("{}")
    assert detect_format(tmp_path / "hf") == "hf"
    with pytest.raises(ValueError, match=r"unknown source format 'csv'; use one of \['auto', 'jsonl'"):
        SourceConfig(format="csv")
    with pytest.raises(ValueError, match=r"text_suffixes must start with '\.'"):
        SourceConfig(text_suffixes=("txt",))
    with pytest.raises(ValueError, match="format='stdlib' reads the interpreter's standard library"):
        Source(tmp_path, SourceConfig(format="stdlib"))
