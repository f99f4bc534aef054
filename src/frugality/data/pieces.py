"""The inputs of `data prepare` cut into pieces that workers tokenize apart and that are
merged back in input order: a whole file (a `.txt` is one document; a compressed file
cannot be entered mid-way), a byte range of a plain `.jsonl` file that starts and ends at
a line boundary, or a parquet row group. A file is a local path or an fsspec URL
(`data.sources`). Every document lies in exactly one piece, and the pieces in order
hold the documents in input order, so the merged dataset is one worker's, byte for byte.

Reading a piece says what is wrong with an input in one line naming the file and the line
(`data.text` for bytes that are not UTF-8)."""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from frugality.data.sources import base_name, found, open_input
from frugality.data.text import json_type, not_utf8
from frugality.errors import UserError

TEXT = (".txt", ".txt.gz", ".txt.zst")
JSONL = (".jsonl", ".jsonl.gz", ".json.gz", ".ndjson", ".jsonl.zst")  # the Pile: .jsonl.zst
PARQUET = (".parquet",)  # a piece a row group
_SPLITTABLE = (".jsonl", ".ndjson")  # plain: a byte range can be read from the middle


@dataclass(frozen=True)
class Piece:
    index: int  # its place in input order: the order of the merge
    file: str  # as the command line gave it
    start: int  # first byte (a line's first); parquet: the row group
    stop: int  # past the last byte (a line's end, or the file's); parquet: the next row group
    weight: int = 0  # bytes of input, for sharing out and progress (parquet: the group's, compressed)

    @property
    def size(self) -> int:
        return self.weight or self.stop - self.start

    def as_dict(self) -> dict:
        return asdict(self)


def plan_pieces(files: list, target_bytes: int, sizes: dict | None = None) -> list[Piece]:
    """The pieces of `files`, in order: a plain `.jsonl` larger than `target_bytes` cut at
    the first line boundary after every `target_bytes`; any other file whole."""
    pieces: list[Piece] = []
    for f in map(str, files):
        if base_name(f).endswith(PARQUET):
            groups = _parquet(f).metadata
            group_sizes = [groups.row_group(g).total_byte_size for g in range(groups.num_row_groups)]
            pieces += [Piece(len(pieces) + g, f, g, g + 1, max(1, n)) for g, n in enumerate(group_sizes)]
            continue
        size = sizes[f] if sizes else found(f).size  # (sizes: the caller looked them up already)
        cuts = [0]
        if base_name(f).endswith(_SPLITTABLE) and size > target_bytes:
            with open_input(f, block_size=1 << 16, cache="none") as raw:  # a line's end: a few KiB read
                while cuts[-1] + target_bytes < size:
                    raw.seek(cuts[-1] + target_bytes)
                    raw.readline()  # to the end of the line the cut fell in
                    if raw.tell() >= size:
                        break
                    cuts.append(raw.tell())
        cuts.append(size)
        pieces += [Piece(len(pieces) + i, f, a, b) for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False))]
    return pieces


def read_documents(piece: Piece, field: str) -> Iterator[str]:
    """The documents of `piece`, in order; a problem is a UserError naming file and line."""
    f, name = piece.file, base_name(piece.file)
    if name.endswith(PARQUET):
        yield from _parquet_documents(f, piece, field)
        return
    try:
        with open_input(f, block_size=max(1 << 16, min(piece.size, 16 << 20))) as raw:
            if name.endswith(TEXT):
                text = io.TextIOWrapper(_decompressed(raw, f), encoding="utf-8", errors="surrogateescape").read()
                _check_utf8(text, f, 1)
                if not text.strip():
                    raise UserError(f"input {f}: empty (no text to tokenize)")
                yield text
                return
            if name.endswith((".gz", ".zst")):
                yield from _jsonl(f, _decompressed(raw, f), field, piece, first_line=1)
                return
            raw.seek(piece.start)
            first = 1 if piece.start == 0 else None  # counted only if a line needs naming
            yield from _jsonl(f, _limited(raw, piece.size), field, piece, first)
    except (OSError, EOFError) as e:  # a corrupt or truncated .gz
        raise UserError(f"input {f}: cannot be read ({e})") from None
    except Exception as e:  # zstandard's ZstdError (a corrupt or truncated .zst)
        if type(e).__name__ != "ZstdError":
            raise
        raise UserError(f"input {f}: cannot be read ({e})") from None


def _parquet(f: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"input {f}: reading parquet needs pyarrow (pip install 'frugality[parquet]')") from None
    source = open_input(f)
    try:
        return pq.ParquetFile(source)
    except Exception as e:  # pyarrow's ArrowInvalid: not a parquet file
        raise UserError(f"input {f}: cannot be read as parquet ({e})") from None


def _parquet_documents(f: str, piece: Piece, field: str) -> Iterator[str]:
    """The `field` column of the piece's row group; a row is named by its number in the
    file (from 1)."""
    file = _parquet(f)
    names = file.schema_arrow.names
    if field not in names:
        raise UserError(f"input {f}: no column {field!r} (columns: {', '.join(names)}; choose one with --field)")
    first = sum(file.metadata.row_group(g).num_rows for g in range(piece.start)) + 1
    values = file.read_row_group(piece.start, columns=[field]).column(field).to_pylist()
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise UserError(f"input {f}: row {first + i}: column {field!r} is not a string ({json_type(value)})")
        yield value


def _decompressed(raw, f: str):
    """`raw` as the bytes it holds: gunzipped (.gz), unzstd'd (.zst), or as it is."""
    if f.endswith(".gz"):
        return gzip.open(raw)
    if f.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise UserError(f"input {f}: .zst needs the zstandard package (pip install zstandard)") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
    return raw


def _limited(raw, size: int) -> io.BufferedReader:
    """`size` bytes of `raw` from where it is, as a stream of lines."""
    return io.BufferedReader(_Window(raw, size), buffer_size=1 << 20)


class _Window(io.RawIOBase):
    def __init__(self, raw, size: int) -> None:
        self.raw, self.left = raw, size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.raw.readinto(memoryview(buffer)[: min(len(buffer), self.left)]) if self.left else 0
        self.left -= n
        return n


def _jsonl(f: str, binary, field: str, piece: Piece, first_line: int | None) -> Iterator[str]:
    lines = io.TextIOWrapper(binary, encoding="utf-8", errors="surrogateescape")
    any_line = False
    for offset, line in enumerate(lines):
        problem = not_utf8(line)
        if problem:
            raise UserError(f"input {f}:{_line(f, piece, first_line, offset)}: {problem[1]}")
        if not line.strip():
            continue
        any_line = True
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"input {f}:{_line(f, piece, first_line, offset)}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict) or field not in record:
            where = _line(f, piece, first_line, offset)
            raise UserError(f"input {f}:{where}: no field {field!r} (choose one with --field)")
        value = record[field]
        if not isinstance(value, str):
            where = _line(f, piece, first_line, offset)
            raise UserError(f"input {f}:{where}: field {field!r} is not a string ({json_type(value)})")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's "\ud800": half of a character, not text
            where = _line(f, piece, first_line, offset)
            raise UserError(
                f"input {f}:{where}: field {field!r} holds a lone surrogate ({value[e.start]!r}), not text"
            ) from None
        yield value
    if not any_line and piece.start == 0 and piece.stop == found(f).size:
        raise UserError(f"input {f}: empty (no JSON lines)")


def _line(f: str, piece: Piece, first_line: int | None, offset: int) -> int:
    """The file's line number of the piece's line `offset` (from 0): the lines before the
    piece are counted only when one is to be named."""
    if first_line is None:
        counted, left = 1, piece.start
        with open_input(f) as raw:
            while left and (chunk := raw.read(min(left, 16 << 20))):  # in chunks: a piece may start at 50 GB
                counted += chunk.count(b"\n")
                left -= len(chunk)
        return counted + offset
    return first_line + offset


def _check_utf8(text: str, f: str, first_line: int) -> None:
    problem = not_utf8(text)
    if problem:
        raise UserError(f"input {f}:{first_line + problem[0] - 1}: {problem[1]}")
