"""`data prepare --dedup exact`: a document whose normalised text was seen earlier in the
input order is dropped, whatever the workers and the pieces, and the count is said."""

from __future__ import annotations

import json
import os

import forked_cli
import pytest

from frugality.data.dedup import normalised
from frugality.data.indexed import IndexedDataset
from frugality.data.prepare import prepare
from frugality.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("pythia")


def _texts():
    """60 documents, 15 of them copies of earlier ones (some only in spacing, case or
    Unicode form), copies spread across the pieces."""
    unique = [f"Document number {i}: {'lorem ipsum ' * (i % 7)}the end." for i in range(45)]
    copies = [unique[3], unique[3].upper(), "  " + unique[10].replace(" ", "\t\n "), unique[44]]
    copies += [unique[i] for i in range(20, 31)]
    texts, c = [], 0
    for i, t in enumerate(unique):
        texts.append(t)
        if i >= 10 and c < len(copies) and i % 2 == 0:
            texts.append(copies[c])
            c += 1
    texts += copies[c:]
    texts.insert(5, "Caf\u00e9 au lait")
    texts.insert(50, "Cafe\u0301 au lait")  # the same text in another Unicode form (NFKC equal)
    return texts


def test_normalised_text_ignores_spacing_case_and_unicode_form():
    assert normalised("  Hello,\tWORLD \n") == normalised("hello, world") == "hello, world"
    assert normalised("Caf\u00e9") == normalised("Cafe\u0301")
    assert normalised("hello world") != normalised("hello, world")


def test_duplicates_are_dropped_in_input_order_the_same_whatever_the_workers(tmp_path, tok):
    texts = _texts()
    with open(tmp_path / "docs.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    kept, seen = [], set()
    for t in texts:
        if normalised(t) not in seen:
            seen.add(normalised(t))
            kept.append(t)
    assert len(texts) - len(kept) == 16
    with open(tmp_path / "kept.jsonl", "w") as f:
        for t in kept:
            f.write(json.dumps({"text": t}) + "\n")
    expected = prepare([tmp_path / "kept.jsonl"], tok, tmp_path / "expected", progress=False, workers=1)
    one = prepare([tmp_path / "docs.jsonl"], tok, tmp_path / "one", progress=False, workers=1, dedup="exact")
    command = ["data", "prepare", tmp_path / "docs.jsonl"]
    command += ["--out", tmp_path / "two", "--workers", "2", "--piece-mb", "0.0005", "--dedup", "exact"]
    two = forked_cli.run(*command, timeout=120)
    assert two.returncode == 0, two.stderr
    assert f"{len(kept)} documents" in two.stdout and "16 duplicates dropped" in two.stdout
    assert one.documents == len(kept) and one.duplicates == 16
    for ext in ("bin", "idx"):
        reference = (tmp_path / f"expected.{ext}").read_bytes()
        assert (tmp_path / f"one.{ext}").read_bytes() == reference
        assert (tmp_path / f"two.{ext}").read_bytes() == reference
    assert IndexedDataset(tmp_path / "two").num_documents == expected.documents == len(kept)


def test_dedup_is_part_of_the_job_a_rerun_cannot_switch(tmp_path, tok):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n{"text": "x"}\n')
    env = {"FRUGALITY_PREPARE_STOP_AFTER": "1"}
    base = ["data", "prepare", tmp_path / "a.jsonl", "--out"]
    killed = forked_cli.run(*base, tmp_path / "o", "--workers", "1", env=os.environ | env)
    assert killed.returncode == 9
    switched = forked_cli.run(*base, tmp_path / "o", "--dedup", "exact")
    assert switched.returncode == 2 and "(its --dedup differ)" in switched.stderr


def test_a_part_whose_hashes_are_damaged_is_redone_on_the_rerun(tmp_path, tok):
    texts = _texts()
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    straight = prepare([tmp_path / "docs.jsonl"], tok, tmp_path / "straight", progress=False, dedup="exact")
    command = ["data", "prepare", tmp_path / "docs.jsonl", "--out"]
    command += [tmp_path / "out", "--workers", "1", "--piece-mb", "0.001", "--dedup", "exact"]
    killed = forked_cli.run(*command, env=os.environ | {"FRUGALITY_PREPARE_STOP_AFTER": "2"})
    assert killed.returncode == 9
    hashes = sorted((tmp_path / "out.parts").glob("*.hashes"))
    assert len(hashes) == 2
    hashes[0].write_bytes(hashes[0].read_bytes()[:-3])  # cut short: the part is not whole
    finished = forked_cli.run(*command)
    assert finished.returncode == 0, finished.stderr
    assert "1 parts from the interrupted run" in finished.stdout
    for ext in ("bin", "idx"):
        assert (tmp_path / f"out.{ext}").read_bytes() == getattr(straight, f"{ext}_path").read_bytes()


def test_a_run_that_cannot_go_on_through_no_fault_of_its_inputs_keeps_its_parts(tmp_path, tok, monkeypatch):
    """A worker lost more often than Ray retries (PartsKept): the parts stay for a rerun,
    where a bad input's run keeps nothing."""
    from frugality.data import prepare as module

    real = module._run

    def run_then_lose_a_worker(*args):
        yield next(real(*args))
        raise module.PartsKept("data prepare: piece 1 failed on the Ray cluster; rerun to go on")

    monkeypatch.setattr(module, "_run", run_then_lose_a_worker)
    (tmp_path / "a.txt").write_text("One.")
    (tmp_path / "b.txt").write_text("Two.")
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    with pytest.raises(module.PartsKept):
        prepare(files, tok, tmp_path / "out", progress=False)
    assert len((tmp_path / "out.parts" / "parts.jsonl").read_text().splitlines()) == 1
    monkeypatch.setattr(module, "_run", real)
    assert prepare(files, tok, tmp_path / "out", progress=False).reused_parts == 1
    with pytest.raises(module.UserError, match=r"--out s3://bucket/x: a local or shared-storage path"):
        prepare(files, tok, "s3://bucket/x", progress=False)
