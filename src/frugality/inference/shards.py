"""A shard of an embedding job: its files (`shard-NNNNN.npy` and `.ids.json`, or `.parquet`,
then `shard-NNNNN.done.json` with their SHA-256, written last), whether it is complete, and
the work of one shard (its texts embedded and written whole), which the local engine
(`inference.embed`) and Ray's (`inference.embed_ray`) both run."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
import warnings
from pathlib import Path

import numpy as np

from frugality.errors import FrugalityWarning
from frugality.inference.batches import batch_defaults, embed_in_chunks
from frugality.inference.inputs import Inputs
from frugality.paths import fsync_dir, write_atomically

# tests: kill@N, the process kills itself after writing N shards; stall@N, it waits there (for a signal)
FAULT_ENV = "FRUGALITY_INJECT_FAULT"


def shard_names(k: int, fmt: str) -> tuple[str, ...]:
    """The files of shard k: (ids, embeddings) for npy, (table,) for parquet."""
    stem = f"shard-{k:05d}"
    return (f"{stem}.ids.json", f"{stem}.npy") if fmt == "npy" else (f"{stem}.parquet",)


def done_name(k: int) -> str:
    """Shard k's last file: the SHA-256 of each of its files, and its texts cut short."""
    return f"shard-{k:05d}.done.json"


def read_done(out: Path, k: int) -> dict | None:
    """Shard k's record, if it was written (and is JSON)."""
    try:
        record = json.loads((out / done_name(k)).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("sha256"), dict) else None


def is_complete(out: Path, k: int, fmt: str, rows: int, hashed: bool = True, verify: bool = True) -> bool:
    """Shard k's record (written last, by a rename) is there and its files match their
    hashes in it (`verify=False`: for shards just written, whose hashes were taken as they
    were); its embeddings hold its `rows`. `hashed=False`: a job begun before shards had
    hashes, whose embeddings file (then written last) marks a complete shard."""
    path = out / shard_names(k, fmt)[-1]
    if not path.is_file():
        return False
    if hashed:
        recorded = read_done(out, k)
        if recorded is None:  # not written yet (a crash in between), or damaged: redo
            return False
        for name in shard_names(k, fmt) if verify else ():
            if recorded["sha256"].get(name) != file_sha256(out / name):
                warnings.warn(
                    f"{out / name}: does not match its SHA-256 in {done_name(k)} (changed since it was "
                    "written); embedding its shard again",
                    FrugalityWarning,
                    stacklevel=2,
                )
                return False
    try:
        if fmt == "npy":
            return np.load(path, mmap_mode="r").shape[0] == rows
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows == rows
    except Exception:  # unreadable: redo it
        return False


def file_sha256(path: Path) -> str | None:
    """The file's SHA-256 (hex), or None where it cannot be read."""
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def shard_texts(inputs: Inputs, size: int, count: int, wanted: set[int]):
    """(shard, ids, texts) for each wanted shard, reading the inputs once."""
    ids: list[str] = []
    texts: list[str] = []
    current = None
    for index, (text_id, text) in enumerate(inputs):
        if index >= count:
            break
        k = index // size
        if k not in wanted:
            continue
        if current is not None and k != current:
            yield current, ids, texts
            ids, texts = [], []
        current = k
        ids.append(text_id)
        texts.append(text)
    if current is not None:
        yield current, ids, texts


def embed_shard(encoder, settings, k, ids, texts, report, written_before) -> int:
    """Embed shard k's texts and write its files (`report(n)` hears of each batch's n texts);
    `written_before`: the shards this process wrote before it (the fault tests count them)."""
    tokens, rows = batch_defaults(encoder)
    vectors, cut = embed_in_chunks(encoder, texts, settings.batch_tokens or tokens, settings.max_batch or rows, report)
    write_shard(Path(settings.out), k, ids, vectors, settings.format, cut)
    fault = os.environ.get(FAULT_ENV)
    if fault == f"kill@{written_before + 1}":
        os.kill(os.getpid(), signal.SIGKILL)  # the reliability test's crash: right after a shard
    if fault == f"stall@{written_before + 1}":
        time.sleep(600)  # the signal test's stop: it comes while the job waits here
    return 1


def write_shard(out: Path, k: int, ids: list[str], vectors: np.ndarray, fmt: str, truncated: int = 0) -> None:
    """Shard k's files, then its record (`truncated`: its texts cut to the model's length)."""
    names = shard_names(k, fmt)
    hashes = {}
    try:
        (out / done_name(k)).unlink(missing_ok=True)  # (a damaged shard's: it is incomplete from here)
        if fmt == "npy":
            hashes[names[0]] = write_atomically(out / names[0], json.dumps(ids).encode(), digest=True)
            # through Python's write: numpy's own (fwrite) says a full disk without its errno
            hashes[names[1]] = write_atomically(out / names[1], lambda f: np.save(_Stream(f), vectors), digest=True)
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            embedding = pa.FixedSizeListArray.from_arrays(vectors.reshape(-1), vectors.shape[1])
            table = pa.table({"id": ids, "embedding": embedding})
            hashes[names[0]] = write_atomically(out / names[0], lambda f: pq.write_table(table, f), digest=True)
        write_atomically(out / done_name(k), json.dumps({"sha256": hashes, "truncated": truncated}, indent=1).encode())
    except BaseException:  # a full disk, Ctrl-C: none of the shard's files stay (its ids alone are no use)
        for name in (*names, done_name(k)):
            (out / name).unlink(missing_ok=True)
        raise
    fsync_dir(out)  # the renames on disk: a power cut cannot undo a complete shard


class _Stream:
    """A file as numpy sees a stream: np.save then writes through the file's `write`."""

    def __init__(self, f) -> None:
        self.write = f.write


def clean_partials(out: Path) -> None:
    """Temporary files of a shard a crash cut short: their shard is redone."""
    for tmp in out.glob(".shard-*.tmp*"):
        tmp.unlink(missing_ok=True)
