"""`data prepare` on several workers: pieces tokenized apart and merged in input order give
one worker's bytes and megatron-core's builder's; a run killed between two parts, rerun,
ends with the same bytes; a changed input is refused in one line, nothing lost."""

from __future__ import annotations

import gzip
import hashlib
import json
import os

import forked_cli
import numpy as np
import pytest

from frugality.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype
from frugality.data.pieces import plan_pieces, read_documents
from frugality.data.prepare import prepare
from frugality.data.tokenizer import load_tokenizer
from frugality.errors import UserError


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("pythia")


def _inputs(folder):
    """A plain .jsonl cut into several pieces, a gzipped one and a .txt: 243 documents."""
    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "é", "\n", "1984", "Ünïcode", "  "]
    texts = [" ".join(rng.choice(words, size=rng.integers(1, 60))) for _ in range(240)]
    with open(folder / "a.jsonl", "w") as f:
        for t in texts[:200]:
            f.write(json.dumps({"text": t}) + "\n")
        f.write("\n")  # a blank line is skipped
    with gzip.open(folder / "b.jsonl.gz", "wt") as f:
        for t in texts[200:]:
            f.write(json.dumps({"text": t}) + "\n")
    (folder / "c.txt").write_text("A book of its own.\n\nTwo paragraphs.\n")
    (folder / "d.txt").write_text("And another.")
    (folder / "e.txt").write_text("And a last one.")
    return [folder / n for n in ("a.jsonl", "b.jsonl.gz", "c.txt", "d.txt", "e.txt")], [
        *texts,
        "A book of its own.\n\nTwo paragraphs.\n",
        "And another.",
        "And a last one.",
    ]


def test_pieces_hold_every_line_once_in_order(tmp_path):
    files, texts = _inputs(tmp_path)
    pieces = plan_pieces(files, 1000)
    assert len([p for p in pieces if p.file.endswith("a.jsonl")]) > 3  # cut at line boundaries
    assert [p.index for p in pieces] == list(range(len(pieces)))
    assert [d for p in pieces for d in read_documents(p, "text")] == texts


def test_workers_write_one_workers_bytes_and_megatron_cores(tmp_path, tok):
    megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    import torch

    files, texts = _inputs(tmp_path)
    one = prepare(files, tok, tmp_path / "one", progress=False, workers=1, piece_bytes=1000)
    two = prepare(files, tok, tmp_path / "two", progress=False, workers=2, piece_bytes=1000)
    assert (one.documents, two.workers) == (len(texts), 2) and one.tokens == two.tokens
    dtype = token_dtype(tok.vocab_size)
    theirs = megatron.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=dtype.type)
    for t in texts:
        theirs.add_item(torch.tensor(tok.encode(t) + [tok.eod_id]))
        theirs.end_document()
    theirs.finalize(str(tmp_path / "theirs.idx"))
    for ext in ("bin", "idx"):
        ours = (tmp_path / f"one.{ext}").read_bytes()
        assert ours == (tmp_path / f"two.{ext}").read_bytes() == (tmp_path / f"theirs.{ext}").read_bytes(), ext
    assert not (tmp_path / "two.parts").exists()  # merged, then removed


def test_merging_appends_datasets_as_one_writer_would(tmp_path):
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 50000, size=rng.integers(0, 30)) for _ in range(20)]
    whole = IndexedDatasetWriter(tmp_path / "whole", np.uint16)
    for d in docs:
        whole.add_document(d)
    whole.finalize()
    for name, part in (("p0", docs[:7]), ("p1", docs[7:])):
        w = IndexedDatasetWriter(tmp_path / name, np.uint16)
        for d in part:
            w.add_document(d)
        w.finalize()
    merged = IndexedDatasetWriter(tmp_path / "merged", np.uint16)
    merged.add_document(docs[0][:0])  # documents added one by one mix with appended ones
    merged.append(tmp_path / "p0")
    merged.append(tmp_path / "p1")
    merged.finalize()
    ds = IndexedDataset(tmp_path / "merged")
    assert ds.num_documents == 21 and all(np.array_equal(ds[i + 1], d) for i, d in enumerate(docs))
    assert (tmp_path / "merged.bin").read_bytes() == (tmp_path / "whole.bin").read_bytes()


def test_appending_some_documents_keeps_their_sequences_as_megatron_cores_builder_writes_them(tmp_path):
    """Documents of several sequences (megatron's sentence splitting), some left out: the
    bytes of megatron-core's builder given only the documents kept."""
    megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    import torch

    rng = np.random.default_rng(2)
    docs = [[rng.integers(0, 50000, size=rng.integers(1, 9)) for _ in range(rng.integers(1, 4))] for _ in range(12)]
    keep = np.array([i % 3 != 1 for i in range(12)])
    for name, chosen in (("all", docs), ("kept", [d for d, k in zip(docs, keep, strict=True) if k])):
        builder = megatron.IndexedDatasetBuilder(str(tmp_path / f"{name}.bin"), dtype=np.uint16)
        for doc in chosen:
            for sequence in doc:
                builder.add_item(torch.from_numpy(sequence.astype(np.int64)))
            builder.end_document()
        builder.finalize(str(tmp_path / f"{name}.idx"))
    merged = IndexedDatasetWriter(tmp_path / "merged", np.uint16)
    merged.append(tmp_path / "kept")  # a first part: the kept documents land after its sequences
    whole_digest = merged.append(tmp_path / "all", keep=keep)
    merged.finalize()
    assert whole_digest == hashlib.sha256((tmp_path / "all.bin").read_bytes()).hexdigest()
    twice = megatron.IndexedDatasetBuilder(str(tmp_path / "twice.bin"), dtype=np.uint16)
    twice.add_index(str(tmp_path / "kept"))
    twice.add_index(str(tmp_path / "kept"))
    twice.finalize(str(tmp_path / "twice.idx"))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"merged.{ext}").read_bytes() == (tmp_path / f"twice.{ext}").read_bytes()
    with pytest.raises(UserError, match="12 documents, not 3 as recorded"):
        IndexedDatasetWriter(tmp_path / "other", np.uint16).append(tmp_path / "all", keep=keep[:3])


def test_a_bad_line_in_a_later_piece_is_named_by_its_line_in_the_file(tmp_path, tok):
    lines = [json.dumps({"text": f"line {i}"}) for i in range(100)]
    lines[77] = '{"text": broken'
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"docs.jsonl:78: not valid JSON"):
        prepare([tmp_path / "docs.jsonl"], tok, tmp_path / "out", progress=False, workers=2, piece_bytes=200)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]  # nothing written, nothing kept


def _left_behind(mark: str) -> list:
    """The processes still alive whose environment holds `mark` (after up to 10 s)."""
    import psutil

    def marked(p):
        try:
            return p.environ().get("TEST_MARK") == mark
        except (psutil.Error, OSError):
            return False

    _, alive = psutil.wait_procs([p for p in psutil.process_iter() if marked(p)], timeout=10)
    return alive


def _prepare(files, out, *extra, env=None):
    import forked_cli

    command = ["data", "prepare", *files, "--out", out, "--workers", "2", "--piece-mb", "0.001", *extra]
    return forked_cli.run(*command, env=os.environ | (env or {}), timeout=120)


def test_a_run_killed_between_parts_finishes_on_a_rerun_with_the_same_bytes(tmp_path, tok):
    files, _ = _inputs(tmp_path)
    straight = prepare(files, tok, tmp_path / "straight", progress=False, workers=1, piece_bytes=1000)
    mark = f"prepare-{os.getpid()}-{tmp_path.name}"
    killed = _prepare(files, tmp_path / "out", env={"FRUGALITY_PREPARE_STOP_AFTER": "3", "TEST_MARK": mark})
    assert killed.returncode == 9 and not (tmp_path / "out.bin").exists()
    assert _left_behind(mark) == []  # the workers died with the command
    job = json.loads((tmp_path / "out.parts" / "job.json").read_text())
    recorded = (tmp_path / "out.parts" / "parts.jsonl").read_text()
    assert len(recorded.splitlines()) == 3
    # the inputs changed under the parts: refused in one line, the parts kept
    (tmp_path / "e.txt").write_text("Edited.")
    refused = _prepare(files, tmp_path / "out")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'out.parts'}: the parts of another preparation (its inputs differ); rerun that one, "
        "or --overwrite to start over"
    ]
    assert (tmp_path / "out.parts" / "parts.jsonl").read_text() == recorded
    (tmp_path / "e.txt").write_text("And a last one.")
    os.utime(tmp_path / "e.txt", ns=(int(job["inputs"][4]["version"]),) * 2)
    other = _prepare(files, tmp_path / "out", "--piece-mb", "0.01")
    assert other.returncode == 2 and "(its --piece-mb differ)" in other.stderr
    with open(tmp_path / "out.parts" / "parts.jsonl", "a") as log:
        log.write('{"index": 9, "docum')  # a record cut by the kill
    finished = _prepare(files, tmp_path / "out")
    assert finished.returncode == 0, finished.stderr
    assert "3 parts from the interrupted run" in finished.stdout
    for ext in ("bin", "idx"):
        assert (tmp_path / f"out.{ext}").read_bytes() == getattr(straight, f"{ext}_path").read_bytes()


def test_a_second_prepare_of_the_same_output_while_the_first_runs_is_refused(tmp_path, tok):
    import fcntl

    files, _ = _inputs(tmp_path)
    with open(tmp_path / "out.parts.lock", "a") as held:  # as a running prepare holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(UserError, match=r"out.parts.lock: another data prepare is writing this output"):
            prepare(files, tok, tmp_path / "out", progress=False, workers=1)
    assert not (tmp_path / "out.parts").exists() and not (tmp_path / "out.bin").exists()


def test_zstandard_inputs_as_the_pile_ships_them(tmp_path, tok):
    import zstandard

    files, texts = _inputs(tmp_path)
    plain = (tmp_path / "a.jsonl").read_bytes()
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(plain))
    (tmp_path / "c.txt.zst").write_bytes(zstandard.ZstdCompressor().compress((tmp_path / "c.txt").read_bytes()))
    zst = [tmp_path / "a.jsonl.zst", tmp_path / "c.txt.zst"]
    prepare(zst, tok, tmp_path / "zst", progress=False, workers=2)
    prepare([files[0], files[2]], tok, tmp_path / "plain", progress=False, workers=1)
    assert (tmp_path / "zst.bin").read_bytes() == (tmp_path / "plain.bin").read_bytes()
    (tmp_path / "bad.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"garbage")
    with pytest.raises(UserError, match=r"input .*bad.jsonl.zst: cannot be read"):
        prepare([tmp_path / "bad.jsonl.zst"], tok, tmp_path / "bad", progress=False, workers=1)


def test_a_quoted_glob_is_expanded_in_order_and_one_that_matches_nothing_is_one_line(tmp_path, tok):
    files, _ = _inputs(tmp_path)
    prepare([str(tmp_path / "*.txt")], tok, tmp_path / "globbed", progress=False, workers=1)
    prepare(files[2:], tok, tmp_path / "listed", progress=False, workers=1)
    assert (tmp_path / "globbed.bin").read_bytes() == (tmp_path / "listed.bin").read_bytes()
    with pytest.raises(UserError, match=r"input .*\*\.parquet: matches no file"):
        prepare([str(tmp_path / "*.parquet")], tok, tmp_path / "none", progress=False)


def test_a_lone_surrogate_in_a_json_string_is_named_by_its_line(tmp_path, tok):
    (tmp_path / "docs.jsonl").write_text('{"text": "fine"}\n{"text": "half \\ud800 a character"}\n')
    with pytest.raises(UserError, match=r"docs.jsonl:2: field 'text' holds a lone surrogate \('\\ud800'\), not text"):
        prepare([tmp_path / "docs.jsonl"], tok, tmp_path / "out", progress=False)


def test_parquet_row_groups_are_pieces_and_give_the_jsonl_bytes(tmp_path, tok):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    _, texts = _inputs(tmp_path)
    pq.write_table(pa.table({"id": list(range(200)), "text": texts[:200]}), tmp_path / "a.parquet", row_group_size=64)
    assert len(plan_pieces([tmp_path / "a.parquet"], 1 << 20)) == 4  # a piece a row group
    prepare([tmp_path / "a.parquet"], tok, tmp_path / "pq", progress=False, workers=2)
    prepare([tmp_path / "a.jsonl"], tok, tmp_path / "jsonl", progress=False, workers=1)
    assert (tmp_path / "pq.bin").read_bytes() == (tmp_path / "jsonl.bin").read_bytes()
    with pytest.raises(UserError, match=r"a.parquet: no column 'body' \(columns: id, text; choose one with --field\)"):
        prepare([tmp_path / "a.parquet"], tok, tmp_path / "none", progress=False, field="body")
    pq.write_table(pa.table({"text": ["fine", None]}), tmp_path / "b.parquet")
    with pytest.raises(UserError, match=r"b.parquet: row 2: column 'text' is not a string \(null\)"):
        prepare([tmp_path / "b.parquet"], tok, tmp_path / "null", progress=False)


@pytest.mark.slow
def test_a_glob_of_s3_urls_prepares_the_local_files_bytes(s3_bucket, tmp_path, tok):
    """Inputs on S3 (a real endpoint on loopback): a glob of URLs, plain `.jsonl` read in
    ranges by two workers, gives the local files' bytes; a missing object is one line."""
    files, _ = _inputs(tmp_path)
    import fsspec

    fs = fsspec.filesystem("s3")
    for f in files:
        fs.put_file(str(f), f"{s3_bucket}/corpus/{f.name}")
    local = prepare(files, tok, tmp_path / "local", progress=False, workers=1, piece_bytes=1000)
    command = ["data", "prepare", f"{s3_bucket}/corpus/*"]
    command += ["--out", tmp_path / "s3", "--workers", "2", "--piece-mb", str(1000 / 2**20)]
    done = forked_cli.run(*command, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"{local.documents:,} documents" in done.stdout
    for ext in ("bin", "idx"):
        assert (tmp_path / f"s3.{ext}").read_bytes() == (tmp_path / f"local.{ext}").read_bytes()
    missing = forked_cli.run("data", "prepare", f"{s3_bucket}/corpus/none.jsonl", "--out", tmp_path / "none")
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [f"error: input {s3_bucket}/corpus/none.jsonl: no such file"]


def test_a_rerun_that_finds_every_part_written_says_so_not_a_rate_of_nothing(frugality_cli, tmp_path):
    (tmp_path / "docs.txt").write_text("A first document.\n\nAnd a second one.\n")
    command = ["data", "prepare", tmp_path / "docs.txt", "--tokenizer", "pythia", "--out", tmp_path / "out"]
    killed = frugality_cli(*command, env=os.environ | {"FRUGALITY_PREPARE_STOP_AFTER": "1"})  # after its one part
    assert killed.returncode == 9 and not (tmp_path / "out.bin").exists()
    finished = frugality_cli(*command)
    assert finished.returncode == 0, finished.stderr
    assert "(1 worker: every part from the interrupted run (1), nothing tokenized again)" in finished.stdout
    assert "0.00 MB/s" not in finished.stdout
