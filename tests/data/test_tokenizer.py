"""The shipped tokenizers are the real ones."""

import gzip
from pathlib import Path

import pytest

from frugality.data.bundled import corpus_files
from frugality.data.tokenizer import load_tokenizer, shipped_tokenizer_dir
from frugality.errors import UserError


def test_pythia_tokenizer_ids():
    t = load_tokenizer("pythia")
    assert t.encode("Hello world") == [12092, 1533]
    assert t.eod_id == 0 and t.vocab_size == 50277
    assert load_tokenizer("gpt-neox-20b").encode("Hello world") == [12092, 1533]


def test_gpt2_tokenizer_ids():
    t = load_tokenizer("gpt2")
    assert t.encode("Hello world") == [15496, 995]
    assert t.eod_id == 50256 and t.vocab_size == 50257


@pytest.mark.parametrize("name", ["pythia", "gpt2"])
def test_round_trip_on_real_text(name):
    t = load_tokenizer(name)
    with gzip.open(corpus_files()[0], "rt", encoding="utf-8") as f:
        text = f.read()[:20000]
    text += "\n\ncafé — naïve “quotes”\t tabs  and   spaces 🙂 12345"
    ids = t.encode(text)
    assert t.decode(ids) == text
    assert t.encode_batch([text, "Hello world"])[0] == ids


def test_tokenizer_paths(tmp_path):
    pythia_json = shipped_tokenizer_dir("pythia") / "tokenizer.json"
    assert load_tokenizer(str(pythia_json)).encode("Hello world") == [12092, 1533]
    assert load_tokenizer(str(shipped_tokenizer_dir("gpt2"))).encode("Hello world") == [15496, 995]
    with pytest.raises(UserError, match="no such file"):
        load_tokenizer(str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot be read"):
        load_tokenizer(str(tmp_path / "bad.json"))


def test_shipped_files_match_shared_assets():
    """The copies inside the package are the checked files from shared/assets."""
    shared = Path(__file__).resolve().parents[3] / "shared" / "assets" / "tokenizers"
    if not shared.is_dir():
        pytest.skip("shared/assets not beside the checkout")
    assert (shipped_tokenizer_dir("pythia") / "tokenizer.json").read_bytes() == (
        shared / "gpt-neox-20b" / "tokenizer.json"
    ).read_bytes()
    for f in ("encoder.json", "vocab.bpe"):
        assert (shipped_tokenizer_dir("gpt2") / f).read_bytes() == (shared / "gpt2" / f).read_bytes()
