"""Tokenizers: the Hugging Face `tokenizers` library, with two real tokenizers shipped.

- `pythia` (alias `gpt-neox-20b`): the GPT-NeoX-20B BPE every Pythia model uses; id 0 is
  `<|endoftext|>`.
- `gpt2`: OpenAI's original GPT-2 byte-level BPE (`encoder.json` + `vocab.bpe`); id 50256
  is `<|endoftext|>`.
- `bert-uncased`: BERT's uncased WordPiece (all-MiniLM-L6-v2's); adds [CLS] ... [SEP]
  where special tokens are asked for; [SEP] ends documents.
Anything else is a path: a `tokenizer.json`, or a folder holding one, or a folder holding
GPT-2-style `vocab.json`/`encoder.json` + `merges.txt`/`vocab.bpe`.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.implementations.byte_level_bpe import ByteLevelBPETokenizer

from frugality.errors import UserError

_ALIASES = {"pythia": "pythia", "gpt-neox-20b": "pythia", "gpt2": "gpt2", "bert-uncased": "bert-uncased"}
_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")


@dataclass(frozen=True)
class LoadedTokenizer:
    tokenizer: Tokenizer
    eod_id: int  # appended after every document
    vocab_size: int  # number of ids the tokenizer can produce (before model padding)
    source: str  # shipped name or resolved path, for provenance in the run directory

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # Runs in parallel threads inside the Rust library (RAYON_NUM_THREADS caps them).
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def shipped_tokenizer_dir(name: str) -> Path:
    return Path(str(resources.files("frugality") / "assets" / "tokenizers" / name))


def load_tokenizer(name_or_path: str) -> LoadedTokenizer:
    if name_or_path in _ALIASES:
        path, source = shipped_tokenizer_dir(_ALIASES[name_or_path]), _ALIASES[name_or_path]
    else:
        path, source = Path(name_or_path), str(Path(name_or_path).resolve())
        if not path.exists():
            raise UserError(
                f"tokenizer {name_or_path!r}: no such file or folder (shipped: {', '.join(sorted(set(_ALIASES)))})"
            )
    tokenizer = _open(path)
    eod = next((tid for t in _EOD_CANDIDATES if (tid := tokenizer.token_to_id(t)) is not None), None)
    if eod is None:
        raise UserError(f"tokenizer {name_or_path!r} has no end-of-document token {_EOD_CANDIDATES}")
    return LoadedTokenizer(tokenizer, eod, tokenizer.get_vocab_size(with_added_tokens=True), source)


def _open(path: Path) -> Tokenizer:
    try:
        if path.is_file():
            return Tokenizer.from_file(str(path))
        if (path / "tokenizer.json").is_file():
            return Tokenizer.from_file(str(path / "tokenizer.json"))
        vocab = _first(path, "vocab.json", "encoder.json")
        merges = _first(path, "merges.txt", "vocab.bpe")
        if vocab and merges:
            # Built as a plain Tokenizer so every caller sees one type.
            bpe = ByteLevelBPETokenizer(str(vocab), str(merges))
            return Tokenizer.from_str(bpe.to_str())
    except Exception as e:  # the library raises bare Exceptions on malformed files
        raise UserError(f"tokenizer {path}: cannot be read: {e}") from None
    raise UserError(f"tokenizer {path}: expected tokenizer.json, or vocab.json/encoder.json + merges.txt/vocab.bpe")


def _first(folder: Path, *names: str) -> Path | None:
    return next((folder / n for n in names if (folder / n).is_file()), None)
