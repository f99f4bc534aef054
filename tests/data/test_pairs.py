"""Text pairs for contrastive training: read, tokenized once, batched into length buckets."""

import gzip

import numpy as np
import pytest

from frugality.data.pairs import PairSamples
from frugality.data.tokenizer import load_tokenizer
from frugality.errors import UserError


def _samples(path, fields=("query", "text"), buckets=(4, 8, 16)):
    return PairSamples(path, load_tokenizer("bert-uncased").tokenizer, fields, buckets, 0.25, seed=3)


def test_batches_stack_queries_positives_negatives_padded_to_the_smallest_bucket(tmp_path):
    path = tmp_path / "pairs.jsonl.gz"
    rows = [f'{{"q": "word {i}", "p": "{" ".join(["long"] * (i % 3 * 5))} gloss", "n": "other"}}' for i in range(8)]
    with gzip.open(path, "wt") as f:
        f.write("\n".join(rows) + "\n\n")
    samples = _samples(path, ("q", "p", "n"))
    assert len(samples.train_ids) == 6 and len(samples.val_ids) == 2 and samples.num_pairs == 8
    short = samples.gather(np.array([0, 3]))  # "gloss" alone: [CLS] gloss [SEP]
    assert short.ids.shape == (6, 4) and short.groups == 3 and short.pairs == 2
    assert short.ids[0].tolist()[0] == 101 and short.mask.sum().item() == sum(len(r.nonzero()) for r in short.ids)
    longest = samples.gather(np.array([0, 2]))  # ten "long" + gloss + [CLS], [SEP]: 13 tokens, bucket 16
    assert longest.ids.shape == (6, 16) and longest.mask[3].sum() == 13


def test_bad_input_is_one_line_naming_the_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"query": "a", "text": "b"}\nnot json\n')
    with pytest.raises(UserError, match=r"pairs.jsonl:2: not valid JSON"):
        _samples(path)
    path.write_text('{"query": "a", "text": "b"}\n')
    with pytest.raises(UserError, match="1 pairs; contrastive training needs at least two"):
        _samples(path)
    with pytest.raises(UserError, match="no such file"):
        _samples(tmp_path / "missing.jsonl")


def test_a_rerun_reads_the_tokens_from_the_cache_and_a_changed_file_is_tokenized_again(tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("FRUGALITY_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(f'{{"query": "word {i}", "text": "gloss number {i}"}}\n' for i in range(6)))
    first = _samples(path)
    [cached] = (tmp_path / "cache" / "pairs").glob("*.npz")
    again = _samples(path)
    assert again.num_pairs == first.num_pairs == 6 and again.num_tokens == first.num_tokens
    assert all(np.array_equal(a, b) for a, b in zip(again._ids, first._ids, strict=True))
    assert np.array_equal(again.gather(np.arange(6)).ids, first.gather(np.arange(6)).ids)
    path.write_text("".join(f'{{"query": "term {i}", "text": "another gloss {i}"}}\n' for i in range(7)))
    os.utime(path, ns=(cached.stat().st_mtime_ns + 10**9,) * 2)
    changed = _samples(path)
    assert changed.num_pairs == 7 and len(list((tmp_path / "cache" / "pairs").glob("*.npz"))) == 2
    [newest] = set((tmp_path / "cache" / "pairs").glob("*.npz")) - {cached}
    newest.write_bytes(b"damaged")  # a damaged cache file: tokenized again, not an error
    assert _samples(path).num_pairs == 7
