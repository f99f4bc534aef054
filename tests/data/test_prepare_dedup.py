"""`data prepare --dedup exact`: a document whose normalised text was seen earlier in the
input order is dropped, whatever the workers and the pieces, and the count is said."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
    command = [sys.executable, "-m", "frugality", "data", "prepare", str(tmp_path / "docs.jsonl")]
    command += ["--out", str(tmp_path / "two"), "--workers", "2", "--piece-mb", "0.0005", "--dedup", "exact"]
    two = subprocess.run(command, capture_output=True, text=True, env=os.environ, timeout=120)
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
    base = [sys.executable, "-m", "frugality", "data", "prepare", str(tmp_path / "a.jsonl"), "--out"]
    killed = subprocess.run([*base, str(tmp_path / "o"), "--workers", "1"], env=os.environ | env, capture_output=True)
    assert killed.returncode == 9
    switched = subprocess.run(
        [*base, str(tmp_path / "o"), "--dedup", "exact"], env=os.environ, capture_output=True, text=True
    )
    assert switched.returncode == 2 and "(its --dedup differ)" in switched.stderr
