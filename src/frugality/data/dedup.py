"""`data prepare --dedup exact`: a document whose normalised text was already seen, earlier
in the input order, is dropped.

Normalised: Unicode NFKC, case folded, every run of white space one space, none at either
end; so copies that differ only in spacing, case or Unicode form are one document. Each
worker hashes its piece's documents (BLAKE2b, 16 bytes: a collision among 10^12 documents
has odds of about 10^-15) beside its part; the merge keeps each hash's first occurrence
across all parts in input order, so the result does not depend on the workers or the
pieces. The merge peaks at 44 bytes a document (the hashes in one array, a stable sort's
order and one sorted copy; tracemalloc over 10^6 digests): about 9 GB for 210 M documents.
"""

from __future__ import annotations

import hashlib
import unicodedata
from pathlib import Path

import numpy as np

from frugality.paths import write_atomically

DIGEST_BYTES = 16
SUFFIX = ".hashes"  # PREFIX.parts/NNNNN.hashes: a part's documents' digests, in order


def normalised(text: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def digest(text: str) -> bytes:
    data = normalised(text).encode("utf-8", "surrogateescape")
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


def write_digests(path: Path, digests: bytearray) -> None:
    """Whole or not at all: a temporary name (of this process: a retried task may race
    another) renamed into place."""
    write_atomically(path, bytes(digests))


def first_occurrences(paths: list[Path]) -> list[np.ndarray]:
    """For each digests file, in order, a mask of its documents to keep: those whose digest
    no earlier document (in this file or an earlier one) had."""
    counts = [p.stat().st_size // DIGEST_BYTES for p in paths]
    digests = np.empty((sum(counts), 2), dtype=np.uint64)  # one array, filled file by file: no copies
    at = 0
    for p, n in zip(paths, counts, strict=True):
        with open(p, "rb") as f:
            # numpy declares ndarray.__buffer__ for Python 3.12 on only; the buffer is there on 3.11 too
            f.readinto(memoryview(digests[at : at + n]).cast("B"))  # pyright: ignore[reportArgumentType]
        at += n
    order = np.lexsort((digests[:, 1], digests[:, 0]))  # stable: equal digests stay in input order
    ordered = digests[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = np.any(ordered[1:] != ordered[:-1], axis=1)
    del ordered
    keep = np.zeros(len(order), dtype=bool)
    keep[order[first]] = True
    return np.split(keep, np.cumsum(counts)[:-1]) if counts else []
