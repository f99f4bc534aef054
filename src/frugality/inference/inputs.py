"""The texts of an offline job, in a fixed order, read as a stream so that millions of them
never sit in memory at once: `.txt` (a text per non-blank line), `.jsonl` (a JSON object
per line; the text and, optionally, the id in named fields) and `.parquet` (the same two
columns; needs pyarrow), gzipped or not for the line formats. A text's id is its id field,
or else `FILE:LINE` (the row number for parquet), FILE as given on the command line."""

from __future__ import annotations

import gzip
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from frugality.data.text import json_type, not_utf8
from frugality.errors import UserError

SUFFIXES = (".txt", ".jsonl", ".parquet")


@dataclass(frozen=True)
class Inputs:
    paths: tuple[Path, ...]
    text_field: str = "text"
    id_field: str | None = None

    def identity(self) -> list[dict]:
        """What a resumed job checks has not changed: each file's path, size and mtime."""
        return [
            {"path": str(p.resolve()), "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} for p in self.paths
        ]

    def check_not_empty(self) -> None:
        """A UserError naming the files when not one of them holds a text (reads up to the first)."""
        if next(iter(self), None) is None:
            names = ", ".join(map(str, self.paths))
            held = "holds" if len(self.paths) == 1 else "hold"
            raise UserError(f"input {names}: {held} no text (empty, or blank lines only)")

    def __iter__(self) -> Iterator[tuple[str, str]]:
        """(id, text) for every text of every file, in order."""
        for path in self.paths:
            kind = _kind(path)
            try:
                if kind == ".parquet":
                    yield from self._parquet(path)
                else:
                    yield from self._lines(path, kind)
            except (OSError, EOFError, UnicodeError) as e:  # not gzip, cut short, unreadable
                raise UserError(f"input {path}: cannot be read ({type(e).__name__}: {e})") from None

    def _lines(self, path: Path, kind: str) -> Iterator[tuple[str, str]]:
        opener = gzip.open if path.suffix == ".gz" else open
        # a BOM is not text; a byte that is not UTF-8 is refused with its line (data.text), never replaced
        with opener(path, "rt", encoding="utf-8-sig", errors="surrogateescape") as f:
            for number, line in enumerate(f, start=1):
                problem = not_utf8(line)
                if problem:
                    raise UserError(f"{path} line {number}: {problem[1]}")
                if kind == ".txt":
                    text = line.rstrip("\r\n")
                    if text.strip():
                        yield f"{path}:{number}", text
                    continue
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"{path} line {number}: not JSON ({e.msg})") from None
                yield self._record(record, path, number)

    def _record(self, record, path: Path, number: int) -> tuple[str, str]:
        if not isinstance(record, dict) or self.text_field not in record:
            raise UserError(f"{path} line {number}: no text field {self.text_field!r} (--text-field names it)")
        if not isinstance(record[self.text_field], str):
            raise UserError(
                f"{path} line {number}: the text field {self.text_field!r} is not a string "
                f"({json_type(record[self.text_field])})"
            )
        if self.id_field is None:
            return f"{path}:{number}", record[self.text_field]
        if not isinstance(record.get(self.id_field), (str, int)) or isinstance(record.get(self.id_field), bool):
            raise UserError(
                f"{path} line {number}: no id field {self.id_field!r} holding a string or an "
                f"integer (--id-field names it)"
            )
        return str(record[self.id_field]), record[self.text_field]

    def _parquet(self, path: Path) -> Iterator[tuple[str, str]]:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UserError(f"{path}: reading parquet needs pyarrow (pip install 'frugality[parquet]')") from None
        columns = [self.text_field] + ([self.id_field] if self.id_field else [])
        file = pq.ParquetFile(path)
        missing = [c for c in columns if c not in file.schema_arrow.names]
        if missing:
            raise UserError(f"{path}: no column {missing[0]!r} (columns: {', '.join(file.schema_arrow.names)})")
        row = 0
        for batch in file.iter_batches(columns=columns, batch_size=8192):
            data = batch.to_pydict()
            for i, text in enumerate(data[self.text_field]):
                row += 1
                if not isinstance(text, str):
                    raise UserError(f"{path} row {row}: the text is {'null' if text is None else type(text).__name__}")
                if self.id_field and data[self.id_field][i] is None:
                    raise UserError(f"{path} row {row}: the id is null")
                yield (str(data[self.id_field][i]) if self.id_field else f"{path}:{row}"), text


def _kind(path: Path) -> str:
    name = path.name.removesuffix(".gz")
    return next((s for s in SUFFIXES if name.endswith(s)), "")


def _glob(folder: Path) -> str:
    """A glob of the files of `folder` that can be read (of its first such file's kind)."""
    for entry in itertools.islice(folder.iterdir(), 1000):
        if _kind(entry):
            return str(folder / f"*{_kind(entry)}{'.gz' if entry.suffix == '.gz' else ''}")
    return str(folder / "*.jsonl")


def open_inputs(paths: list[str], text_field: str = "text", id_field: str | None = None) -> Inputs:
    """Check every input exists and has a known format before anything is written."""
    if not paths:
        raise UserError("no input: give .txt, .jsonl or .parquet files")
    checked = []
    for p in map(Path, paths):
        if p.is_dir():
            raise UserError(f"input {p}: a directory; give its files, e.g. {_glob(p)}")
        if not p.is_file():
            raise UserError(f"input {p}: no such file")
        if not _kind(p) or (p.suffix == ".gz" and _kind(p) == ".parquet"):
            raise UserError(f"input {p}: expected .txt, .jsonl (optionally .gz) or .parquet")
        if not os.access(p, os.R_OK):
            raise UserError(f"input {p}: not readable")
        checked.append(p)
    return Inputs(tuple(checked), text_field, id_field)
