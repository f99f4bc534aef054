"""`frugality data prepare`: text files -> a Megatron indexed dataset.

Inputs are `.txt` (one document per file) and `.jsonl` (one document per line, in field
`text` or another), optionally gzip-compressed. Each document becomes one sequence
followed by one end-of-document token. Tokenization runs in batches through the HF
`tokenizers` library, which spreads a batch over all cores.
"""

from __future__ import annotations

import gzip
import io
import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from frugality.data.indexed import IndexedDatasetWriter, paths, token_dtype
from frugality.data.text import json_type, not_utf8
from frugality.data.tokenizer import LoadedTokenizer
from frugality.errors import UserError

_TEXT = (".txt", ".txt.gz")
_JSONL = (".jsonl", ".jsonl.gz", ".json.gz", ".ndjson")
_BATCH_CHARS = 4_000_000  # large enough to keep every core busy, small enough for memory


@dataclass(frozen=True)
class PrepareStats:
    documents: int
    tokens: int
    bin_path: Path
    idx_path: Path


def prepare(
    inputs: Sequence[str | Path],
    tokenizer: LoadedTokenizer,
    out_prefix: str | Path,
    field: str = "text",
    overwrite: bool = False,
    progress: bool = True,
) -> PrepareStats:
    files = [Path(p) for p in inputs]
    _check_inputs(files, out_prefix, overwrite)
    Path(out_prefix).parent.mkdir(parents=True, exist_ok=True)  # the inputs are good: make room
    writer = IndexedDatasetWriter(out_prefix, token_dtype(tokenizer.vocab_size))
    documents = 0
    total = sum(f.stat().st_size for f in files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not progress)
    try:
        batch: list[str] = []
        size = 0
        for text, advanced in _iter_documents(files, field):
            batch.append(text)
            size += len(text)
            bar.update(advanced)
            if size >= _BATCH_CHARS:
                documents += _write(writer, tokenizer, batch)
                batch, size = [], 0
                bar.set_postfix(docs=documents, tokens=writer.num_tokens)
        documents += _write(writer, tokenizer, batch)
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    bin_path, idx_path = paths(out_prefix)
    return PrepareStats(documents, writer.num_tokens, bin_path, idx_path)


def _write(writer: IndexedDatasetWriter, tokenizer: LoadedTokenizer, texts: list[str]) -> int:
    eod = np.asarray([tokenizer.eod_id])
    for ids in tokenizer.encode_batch(texts):
        writer.add_document(np.concatenate([np.asarray(ids, dtype=np.int64), eod]))
    return len(texts)


def _check_inputs(files: list[Path], out_prefix: str | Path, overwrite: bool) -> None:
    if not files:
        raise UserError("data prepare: no input files given")
    for f in files:
        if f.is_dir():
            raise UserError(f"input {f}: a directory; give its files, e.g. {_glob(f)}")
        if not f.is_file():
            raise UserError(f"input {f}: no such file")
        if not f.name.endswith(_TEXT + _JSONL):
            raise UserError(f"input {f}: unsupported type (expected {', '.join(_TEXT + _JSONL)})")
        if f.stat().st_size == 0:
            raise UserError(f"input {f}: empty (no text to tokenize)")
    for p in paths(out_prefix):
        if p.exists() and not overwrite:
            raise UserError(f"output {p} already exists (choose another --out, or --overwrite)")
        if p.parent.exists() and not p.parent.is_dir():
            raise UserError(f"output folder {p.parent} is a file")


def _glob(folder: Path) -> str:
    """A glob of the files of `folder` that data prepare reads (of its first such file's kind)."""
    suffixes = sorted(_TEXT + _JSONL, key=len, reverse=True)  # .txt.gz before .txt
    for entry in itertools.islice(folder.iterdir(), 1000):
        kind = next((s for s in suffixes if entry.name.endswith(s)), None)
        if kind:
            return str(folder / f"*{kind}")
    return str(folder / "*.txt")


def _iter_documents(files: list[Path], field: str) -> Iterator[tuple[str, int]]:
    """(document text, bytes of input read since the previous document) for the progress bar."""
    for f in files:
        with open(f, "rb") as raw:
            binary = gzip.open(raw) if f.suffix == ".gz" else raw
            # a byte that is not UTF-8 is found, and named by its line, below (data.text)
            lines = io.TextIOWrapper(binary, encoding="utf-8", errors="surrogateescape")
            last = 0
            try:
                if f.name.endswith(_TEXT):
                    text = lines.read()
                    _check_utf8(text, f, 1)
                    if not text.strip():
                        raise UserError(f"input {f}: empty (no text to tokenize)")
                    yield text, f.stat().st_size
                    continue
                found = False
                for lineno, line in enumerate(lines, start=1):
                    _check_utf8(line, f, lineno)
                    if line.strip():
                        found = True
                        yield _field(line, field, f, lineno), raw.tell() - last
                        last = raw.tell()
                if not found:
                    raise UserError(f"input {f}: empty (no JSON lines)")
            except (OSError, EOFError) as e:  # a corrupt or truncated .gz
                raise UserError(f"input {f}: cannot be read ({e})") from None


def _check_utf8(text: str, f: Path, first_line: int) -> None:
    problem = not_utf8(text)
    if problem:
        raise UserError(f"input {f}:{first_line + problem[0] - 1}: {problem[1]}")


def _field(line: str, field: str, f: Path, lineno: int) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"input {f}:{lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(record, dict) or field not in record:
        raise UserError(f"input {f}:{lineno}: no field {field!r} (choose one with --field)")
    value = record[field]
    if not isinstance(value, str):
        raise UserError(f"input {f}:{lineno}: field {field!r} is not a string ({json_type(value)})")
    return value
