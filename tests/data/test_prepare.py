"""`data prepare`: text and JSONL into a Megatron dataset, and clear refusals."""

import gzip
import json

import numpy as np
import pytest

from frugality.data.indexed import IndexedDataset
from frugality.data.prepare import prepare
from frugality.data.tokenizer import load_tokenizer
from frugality.errors import UserError


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("pythia")


def test_documents_end_with_eod(tmp_path, tok):
    texts = ["First document.", "Second one, longer: " + "words " * 50, "Third"]
    with gzip.open(tmp_path / "docs.jsonl.gz", "wt") as f:
        for t in texts:
            f.write(json.dumps({"body": t, "id": 1}) + "\n")
    (tmp_path / "book.txt").write_text("A whole book\n\nin one file.\n")
    stats = prepare(
        [tmp_path / "docs.jsonl.gz", tmp_path / "book.txt"], tok, tmp_path / "out", field="body", progress=False
    )
    ds = IndexedDataset(tmp_path / "out")
    assert stats.documents == ds.num_documents == 4
    for i, text in enumerate(texts + ["A whole book\n\nin one file.\n"]):
        np.testing.assert_array_equal(ds[i], tok.encode(text) + [tok.eod_id])
    assert ds.dtype == np.uint16


def test_bad_jsonl_line_names_file_and_line_and_writes_nothing(tmp_path, tok):
    (tmp_path / "docs.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(UserError, match=r"docs.jsonl:2: not valid JSON"):
        prepare([tmp_path / "docs.jsonl"], tok, tmp_path / "out", progress=False)
    (tmp_path / "nofield.jsonl").write_text('{"content": "ok"}\n')
    with pytest.raises(UserError, match=r"nofield.jsonl:1: no field 'text'"):
        prepare([tmp_path / "nofield.jsonl"], tok, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "nofield.jsonl"]


def test_existing_output_is_not_overwritten(tmp_path, tok):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "out.bin").write_bytes(b"precious")
    with pytest.raises(UserError, match="already exists"):
        prepare([tmp_path / "a.txt"], tok, tmp_path / "out", progress=False)
    assert (tmp_path / "out.bin").read_bytes() == b"precious"
    prepare([tmp_path / "a.txt"], tok, tmp_path / "out", overwrite=True, progress=False)
    assert IndexedDataset(tmp_path / "out").num_documents == 1


def test_unsupported_and_missing_inputs(tmp_path, tok):
    (tmp_path / "a.csv").write_text("x")
    with pytest.raises(UserError, match="unsupported type"):
        prepare([tmp_path / "a.csv"], tok, tmp_path / "out", progress=False)
    with pytest.raises(UserError, match="no such file"):
        prepare([tmp_path / "missing.txt"], tok, tmp_path / "out", progress=False)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(UserError, match="not UTF-8"):
        prepare([tmp_path / "latin1.txt"], tok, tmp_path / "out", progress=False)
    assert not (tmp_path / "out.bin").exists()


def test_the_output_folder_is_made_and_empty_inputs_are_refused(tmp_path, tok, capsys):
    from frugality.cli.main import main

    text = tmp_path / "a.txt"
    text.write_text("Some text to tokenize.")
    stats = prepare([text], tok, tmp_path / "new" / "folder" / "books", progress=False)  # as the README says
    assert stats.documents == 1 and stats.bin_path.is_file()
    assert main(["data", "inspect", str(stats.bin_path)]) == 0  # the .bin's name works as the prefix
    assert main(["data", "inspect", str(stats.idx_path)]) == 0
    assert capsys.readouterr().out.count("1 documents") == 2
    for name, content in (("empty.txt", ""), ("blank.txt", "  \n"), ("empty.jsonl", "\n\n")):
        (tmp_path / name).write_text(content)
        with pytest.raises(UserError, match=f"input {tmp_path / name}: empty"):
            prepare([tmp_path / name], tok, tmp_path / "out" / name, progress=False)
    assert not list(tmp_path.glob("out/**/*.bin"))  # nothing written for them


def _one_error(capsys, argv) -> str:
    from frugality.cli.main import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line]  # the progress bar aside
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_a_directory_or_a_text_that_is_not_a_string_is_said_as_such(tmp_path, capsys):
    books = tmp_path / "books"
    books.mkdir()
    (books / "a.jsonl.gz").write_bytes(b"")
    out = str(tmp_path / "out")
    assert _one_error(capsys, ["data", "prepare", str(books), "--out", out]) == (
        f"error: input {books}: a directory; give its files, e.g. {books}/*.jsonl.gz"
    )
    (tmp_path / "empty").mkdir()
    assert f"a directory; give its files, e.g. {tmp_path / 'empty'}/*.txt" in _one_error(
        capsys, ["data", "prepare", str(tmp_path / "empty"), "--out", out]
    )
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text('{"text": "fine"}\n{"text": 123}\n')
    assert _one_error(capsys, ["data", "prepare", str(numbers), "--out", out]) == (
        f"error: input {numbers}:2: field 'text' is not a string (a number)"
    )
    (tmp_path / "null.jsonl").write_text('{"text": null}\n')
    assert "null.jsonl:1: field 'text' is not a string (null)" in _one_error(
        capsys, ["data", "prepare", str(tmp_path / "null.jsonl"), "--out", out]
    )
    assert not list(tmp_path.glob("out*"))


def test_a_byte_that_is_not_utf8_is_named_by_file_line_and_offset(tmp_path, capsys):
    """The policy `embed` shares: refused, never replaced, nothing written."""
    (tmp_path / "book.txt").write_bytes("line one\nline two\nthe café\n".encode("latin-1"))
    with gzip.open(tmp_path / "docs.jsonl.gz", "wb") as f:
        f.write(b'{"text": "fine \xc3\xa9"}\n{"text": "caf\xe9"}\n')
    out = str(tmp_path / "out")
    assert _one_error(capsys, ["data", "prepare", str(tmp_path / "book.txt"), "--out", out]) == (
        f"error: input {tmp_path / 'book.txt'}:3: not UTF-8 text (byte 0xe9 at offset 7 in the line)"
    )
    assert _one_error(capsys, ["data", "prepare", str(tmp_path / "docs.jsonl.gz"), "--out", out]) == (
        f"error: input {tmp_path / 'docs.jsonl.gz'}:2: not UTF-8 text (byte 0xe9 at offset 13 in the line)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["book.txt", "docs.jsonl.gz"]


def test_temporary_files_of_killed_runs_are_removed_and_a_live_runs_kept(tmp_path, capsys):
    """A killed `data prepare` leaves PREFIX.bin.tmpPID (and .idx.tmpPID): the next run of
    the same prefix removes those whose process is gone, and leaves a live run's alone: one
    whose PID runs here, or one whose writer holds its lock (from another machine)."""
    import fcntl
    import os
    import subprocess

    from frugality.cli.main import main

    dead = subprocess.Popen(["true"])
    dead.wait()  # its PID names a process that is gone
    gone = [tmp_path / f"books.bin.tmp{dead.pid}", tmp_path / f"books.idx.tmp{dead.pid}"]
    live_here = tmp_path / f"books.bin.tmp{os.getppid()}"
    elsewhere = tmp_path / f"books.bin.tmp{2**22 + 12345}"  # above any PID here, but its lock is held
    other = tmp_path / f"other.bin.tmp{dead.pid}"  # another prefix's: not this run's to judge
    for path in (*gone, live_here, elsewhere, other):
        path.write_bytes(b"partial")
    (tmp_path / "book.txt").write_text("A whole book in one file.")
    with open(elsewhere, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert main(["data", "prepare", str(tmp_path / "book.txt"), "--out", str(tmp_path / "books")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["book.txt", "books.bin", "books.idx", live_here.name, elsewhere.name, other.name]
    )
    assert IndexedDataset(tmp_path / "books").num_documents == 1
