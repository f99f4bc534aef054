"""The Megatron indexed dataset (`PREFIX.bin` + `PREFIX.idx`, "MMIDIDX" version 1).

Byte-compatible with megatron-core's `IndexedDatasetBuilder` / `IndexedDataset` (the tests
check both directions against the real package). Layout of `.idx`, all little-endian:

    magic b"MMIDIDX\\x00\\x00" | version u64 = 1 | dtype code u8 | sequence count N u64 |
    document-index length D u64 | lengths int32[N] | byte pointers int64[N] | doc index int64[D]

`.bin` is the token ids of every sequence back to back, no header. The document index is
0 followed by the number of sequences seen at the end of each document.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import struct
from pathlib import Path

import numpy as np

from frugality.errors import UserError
from frugality.paths import NamedFile, naming

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, D
# megatron-core's codes (GPT-NeoX swaps 6 and 7, which only matter for float data).
_DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
_CODE_OF = {np.dtype(v): k for k, v in _DTYPE_CODES.items()}


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits with margin (megatron-core's rule: fewer than 65,500), else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def paths(prefix: str | Path) -> tuple[Path, Path]:
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


class IndexedDatasetWriter:
    """Streams documents into `PREFIX.bin`/`.idx`.

    Both files are written under temporary names and renamed into place by `finalize`, so
    a crash never leaves a half-written dataset where a reader would pick it up. A temporary
    file is `NAME.tmpPID`, locked while its writer lives: a later writer of the same prefix
    removes those of writers that were killed (see `_remove_stale`).
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype) -> None:
        self.bin_path, self.idx_path = paths(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        _remove_stale(self.bin_path, self.idx_path)
        self._tmp_bin = self.bin_path.with_name(self.bin_path.name + f".tmp{os.getpid()}")
        self._tmp_idx = self.idx_path.with_name(self.idx_path.name + f".tmp{os.getpid()}")
        with naming(self.bin_path):
            # (a full disk names the dataset); open until finish or abort
            self._bin = NamedFile(open(self._tmp_bin, "wb"), self.bin_path)  # noqa: SIM115
        fcntl.flock(self._bin.fileno(), fcntl.LOCK_EX)  # held until renamed: this file is a live writer's
        # sequence lengths and document ends: arrays (whole appended datasets), then the
        # documents added one by one since the last array
        self._length_arrays: list[np.ndarray] = []
        self._end_arrays: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self._lengths: list[int] = []
        self._ends: list[int] = []
        self.num_sequences = 0
        self.num_tokens = 0
        self._digest = hashlib.sha256()  # of the .bin, as written

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()

    def add_document(self, tokens: np.ndarray | list[int]) -> None:
        """One document stored as one sequence (what megatron's preprocess_data writes)."""
        array = np.asarray(tokens, dtype=self.dtype)
        data = array.tobytes(order="C")
        self._digest.update(data)
        self._bin.write(data)
        self._lengths.append(array.size)
        self.num_sequences += 1
        self._ends.append(self.num_sequences)
        self.num_tokens += array.size

    def append(self, prefix: str | Path, chunk_bytes: int = 16 << 20, keep: np.ndarray | None = None) -> str:
        """A whole dataset's sequences and documents after those written so far (as
        megatron-core's `add_index` does), or only the documents `keep` (a mask, one entry a
        document) marks; returns the sha256 of its whole .bin, read once."""
        part = IndexedDataset(prefix)
        if part.dtype != self.dtype:
            raise UserError(f"dataset {part.prefix}: tokens are {part.dtype}, not {self.dtype} as the rest")
        if keep is not None and len(keep) != part.num_documents:
            raise UserError(f"dataset {part.prefix}: {part.num_documents} documents, not {len(keep)} as recorded")
        self._settle()
        digest = hashlib.sha256()
        whole = keep is None or bool(np.all(keep))
        with open(paths(part.prefix)[0], "rb") as source:
            while chunk := source.read(chunk_bytes):
                digest.update(chunk)
                if whole:
                    self._digest.update(chunk)
                    self._bin.write(chunk)
        if not whole:
            self._append_documents(part, np.asarray(keep, dtype=bool))
            return digest.hexdigest()
        self._length_arrays.append(np.asarray(part.sequence_lengths, dtype=np.int32))
        self._end_arrays.append(np.asarray(part.document_indices[1:], dtype=np.int64) + self.num_sequences)
        self.num_sequences += part.num_sequences
        self.num_tokens += part.num_tokens
        return digest.hexdigest()

    def _append_documents(self, part: IndexedDataset, keep: np.ndarray) -> None:
        """The documents of `part` that `keep` marks, their sequences copied run by run."""
        per_document = np.diff(np.asarray(part.document_indices, dtype=np.int64))
        kept_sequences = np.repeat(keep, per_document)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], kept_sequences.astype(np.int8), [0]])))
        lengths = np.asarray(part.sequence_lengths, dtype=np.int32)
        pointers = np.asarray(part.sequence_pointers, dtype=np.int64) // self.dtype.itemsize
        for first, stop in zip(edges[::2], edges[1::2], strict=True):  # [first, stop): sequences kept in a row
            data = part.tokens[pointers[first] : pointers[stop - 1] + lengths[stop - 1]].tobytes()
            self._digest.update(data)
            self._bin.write(data)
        self._length_arrays.append(lengths[kept_sequences])
        self._end_arrays.append(np.cumsum(per_document[keep]) + self.num_sequences)
        self.num_sequences += int(kept_sequences.sum())
        self.num_tokens += int(lengths[kept_sequences].sum(dtype=np.int64))

    def _settle(self) -> None:
        """The documents added one by one, as arrays."""
        if self._lengths:
            self._length_arrays.append(np.asarray(self._lengths, dtype=np.int32))
            self._end_arrays.append(np.asarray(self._ends, dtype=np.int64))
            self._lengths, self._ends = [], []

    def finalize(self) -> None:
        self._bin.flush()
        self._settle()
        lengths = np.concatenate([np.zeros(0, dtype=np.int32), *self._length_arrays])
        ends = np.concatenate(self._end_arrays)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with naming(self.idx_path), open(self._tmp_idx, "wb") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # as the .bin's, until both are renamed
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(lengths), len(ends)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(ends.tobytes(order="C"))
            f.flush()
            os.replace(self._tmp_bin, self.bin_path)
            os.replace(self._tmp_idx, self.idx_path)
        self._bin.close()

    def abort(self) -> None:
        self._bin.close()
        for tmp in (self._tmp_bin, self._tmp_idx):
            tmp.unlink(missing_ok=True)


def _remove_stale(*finals: Path) -> None:
    """Remove the temporary files (`NAME.tmpPID`) that killed writers of these files left: a
    file whose process is gone and whose lock no one holds. A live writer's is left alone:
    its PID is alive here, or (writing from another machine to a shared folder) it holds
    the lock."""
    for final in finals:
        for tmp in final.parent.glob(glob.escape(final.name) + ".tmp*"):
            pid = tmp.name.removeprefix(final.name + ".tmp")
            if not pid.isdigit() or _alive(int(pid)):
                continue
            try:
                with open(tmp, "rb") as f:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    tmp.unlink()
            except (BlockingIOError, FileNotFoundError):  # held by a live writer, or already gone
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


class IndexedDataset:
    """Read-only view over `PREFIX.bin`/`.idx` through numpy memory maps (nothing is loaded)."""

    def __init__(self, prefix: str | Path) -> None:
        prefix = str(prefix)
        if prefix.endswith((".bin", ".idx")) and not Path(prefix + ".bin").exists():
            prefix = prefix[:-4]  # the prefix named by one of its files
        self.prefix = prefix
        bin_path, idx_path = paths(prefix)
        for p in (bin_path, idx_path):
            if not p.is_file():
                raise UserError(f"dataset {self.prefix}: {p} does not exist")
        header = idx_path.read_bytes()[: _HEADER.size]
        if len(header) < _HEADER.size:
            raise UserError(f"dataset {idx_path}: truncated header")
        magic, version, code, n, d = _HEADER.unpack(header)
        if magic != MAGIC or version != VERSION:
            raise UserError(f"dataset {idx_path}: not a Megatron MMIDIDX version 1 index")
        if code not in _DTYPE_CODES:
            raise UserError(f"dataset {idx_path}: dtype code {code} is not an integer token type")
        self.dtype = np.dtype(_DTYPE_CODES[code])
        expected = _HEADER.size + 12 * n + 8 * d
        if idx_path.stat().st_size < expected:
            raise UserError(f"dataset {idx_path}: truncated (expected at least {expected} bytes)")
        idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
        offset = _HEADER.size
        self.sequence_lengths = idx[offset : offset + 4 * n].view(np.int32)
        offset += 4 * n
        self.sequence_pointers = idx[offset : offset + 8 * n].view(np.int64)
        offset += 8 * n
        self.document_indices = idx[offset : offset + 8 * d].view(np.int64)
        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        if bin_path.stat().st_size != self.num_tokens * self.dtype.itemsize:
            raise UserError(
                f"dataset {bin_path}: size {bin_path.stat().st_size} bytes does not match the "
                f"index ({self.num_tokens} tokens of {self.dtype})"
            )
        # The token stream of all sequences back to back; documents end with EOD tokens
        # when written by `frugality data prepare` (or megatron's preprocess_data --append-eod).
        self.tokens = (
            np.memmap(bin_path, dtype=self.dtype, mode="r") if self.num_tokens else np.zeros(0, dtype=self.dtype)
        )

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __len__(self) -> int:
        return self.num_sequences

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.sequence_lengths[i])]
