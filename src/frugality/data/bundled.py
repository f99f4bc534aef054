"""The public-domain English corpus shipped with frugality (six Project Gutenberg books,
about 2.6 MB of text; see assets/README.md), tokenized on first use and cached."""

from __future__ import annotations

import fcntl
import hashlib
from importlib import resources
from pathlib import Path

from frugality.data.indexed import paths
from frugality.data.prepare import prepare
from frugality.data.tokenizer import LoadedTokenizer
from frugality.paths import cache_dir

BUNDLED_PREFIX = "bundled:"
_CORPORA = ("gutenberg",)
_PAIRS = {"wordnet": "wordnet-glosses.jsonl.gz"}  # (query, positive) text pairs


def corpus_files(name: str = "gutenberg") -> list[Path]:
    if name not in _CORPORA:
        raise ValueError(f"no bundled corpus {name!r} (have: {', '.join(_CORPORA)})")
    folder = resources.files("frugality") / "assets" / "corpus"
    return sorted(Path(str(p)) for p in folder.iterdir() if p.name.endswith(".txt.gz"))


def bundled_pairs(name: str) -> str:
    """Path of a bundled JSONL of text pairs (for contrastive training)."""
    if name not in _PAIRS:
        raise ValueError(f"no bundled pairs {name!r} (have: {', '.join(_PAIRS)}; or give a .jsonl path)")
    return str(resources.files("frugality") / "assets" / "pairs" / _PAIRS[name])


def bundled_dataset(name: str, tokenizer: LoadedTokenizer, progress: bool = True) -> str:
    """Prefix of the Megatron dataset for a bundled corpus, preparing it if not cached.

    The cache key hashes the corpus files and the tokenizer, so a changed tokenizer or
    corpus never reuses stale tokens. Files appear atomically (see IndexedDatasetWriter).
    """
    files = corpus_files(name)
    digest = hashlib.sha256(tokenizer.tokenizer.to_str().encode())
    for f in files:
        digest.update(f.name.encode() + f.read_bytes())
    prefix = cache_dir() / "data" / f"{name}-{digest.hexdigest()[:16]}" / "tokens"
    if all(p.is_file() for p in paths(prefix)):
        return str(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    # every rank of a run asks at once: the first prepares, the others wait, then read it
    with open(prefix.parent / "prepare.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all(p.is_file() for p in paths(prefix)):
            prepare(files, tokenizer, prefix, overwrite=True, progress=progress, workers=1)  # (inside a run)
    return str(prefix)
