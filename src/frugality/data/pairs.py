"""Text pairs for contrastive training: (query, positive[, negative]) rows of a JSONL file
(gzipped or not), the field names chosen by the recipe (`data.fields`).

Every text is tokenized once, with the tokenizer's special tokens ([CLS] ... [SEP]), and
cut to the longest length bucket (`data.seq_len`); the token ids are kept in the cache
(`$FRUGALITY_CACHE/pairs/`, keyed by the file's path, size and time, the tokenizer, the
fields and the length), so a rerun on the same file does not tokenize it again. A batch stacks its queries, then its
positives, then its negatives into one (groups x pairs, L) array, padded to the smallest
bucket that holds its longest text: a run meets at most one shape per bucket, so compiled
graphs never recompile once each bucket has been seen.

`PairSamples` has what `frugality.data.loader.TrainStream` needs (`seed`, `train_ids`,
`gather`), so the stream's resumable, world-size-independent order serves pairs as it
serves packed token blocks.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from frugality.errors import UserError
from frugality.paths import write_atomically


@dataclass
class TextBatch:
    """Token ids and attention mask of `groups` texts per pair, stacked group by group."""

    ids: torch.Tensor  # (groups * pairs, L) int64, padded with 0
    mask: torch.Tensor  # (groups * pairs, L) int64: 1 for a token, 0 for padding
    groups: int  # 2: query, positive; 3: and a negative

    @property
    def pairs(self) -> int:
        return self.ids.shape[0] // self.groups

    def to(self, device, non_blocking: bool = False) -> TextBatch:
        return TextBatch(
            self.ids.to(device, non_blocking=non_blocking), self.mask.to(device, non_blocking=non_blocking), self.groups
        )


def read_pairs(path: Path, fields: tuple[str, ...]) -> list[list[str]]:
    """The texts of each field, one list per field; a bad line is one error naming it."""
    columns: list[list[str]] = [[] for _ in fields]
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"{path}:{number}: not valid JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise UserError(f"{path}:{number}: expected a JSON object with fields {', '.join(fields)}")
                for column, name in zip(columns, fields, strict=True):
                    text = row.get(name)
                    if not isinstance(text, str) or not text.strip():
                        raise UserError(
                            f"{path}:{number}: field {name!r} is missing or not a non-empty string "
                            "(choose the fields with data.fields)"
                        )
                    column.append(text)
    except (OSError, EOFError, UnicodeDecodeError) as e:
        if isinstance(e, FileNotFoundError):
            raise UserError(f"data.dataset {path}: no such file") from None
        raise UserError(f"data.dataset {path}: cannot be read ({type(e).__name__}: {e})") from None
    if len(columns[0]) < 2:
        raise UserError(f"data.dataset {path}: {len(columns[0])} pairs; contrastive training needs at least two")
    return columns


def _tokenized(path: Path, tokenizer: Tokenizer, fields: tuple[str, ...], longest: int):
    """The ids and starts of each field's texts: from the cache, or tokenized and cached."""
    import hashlib

    from frugality.paths import cache_dir

    tokenizer.enable_truncation(longest)  # (set either way: the caller's tokenizer as it was before the cache)
    tokenizer.no_padding()
    try:
        st = path.stat()
    except FileNotFoundError:
        raise UserError(f"data.dataset {path}: no such file") from None
    identity = json.dumps([str(path.resolve()), st.st_size, st.st_mtime_ns, list(fields), longest])
    key = hashlib.sha256(identity.encode() + tokenizer.to_str().encode()).hexdigest()[:24]
    cached = cache_dir() / "pairs" / f"{key}.npz"
    try:
        with np.load(cached) as saved:
            return [saved[f"ids{g}"] for g in range(len(fields))], [saved[f"starts{g}"] for g in range(len(fields))]
    except (OSError, KeyError, ValueError):  # not cached yet (or a damaged file: tokenized again)
        pass
    columns = read_pairs(path, fields)
    ids, starts = [], []
    for texts in columns:
        rows = [e.ids for e in tokenizer.encode_batch(texts)]
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        starts.append(np.concatenate([[0], np.cumsum(lengths)]))
        ids.append(np.fromiter((t for r in rows for t in r), dtype=np.int32, count=int(lengths.sum())))
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        arrays = {f"ids{g}": a for g, a in enumerate(ids)} | {f"starts{g}": a for g, a in enumerate(starts)}
        write_atomically(cached, lambda f: np.savez(f, **arrays))
    except OSError:  # a cache that cannot be written: tokenized again next time
        pass
    return ids, starts


class PairSamples:
    """Tokenized pairs, split into training and validation by a seeded permutation."""

    def __init__(
        self,
        path: str | Path,
        tokenizer: Tokenizer,
        fields: tuple[str, ...],
        buckets: tuple[int, ...],
        val_fraction: float,
        seed: int,
    ) -> None:
        self.path, self.seed, self.groups = Path(path), seed, len(fields)
        self.buckets = tuple(sorted(buckets))
        # One flat array of ids per field, and each text's start: compact for millions of texts.
        self._ids, self._starts = _tokenized(self.path, tokenizer, fields, self.buckets[-1])
        self.num_pairs = len(self._starts[0]) - 1
        self.num_tokens = int(sum(len(ids) for ids in self._ids))
        order = np.random.default_rng([seed, 0xDA7A]).permutation(self.num_pairs)
        n_val = max(1, round(val_fraction * self.num_pairs))
        if n_val >= self.num_pairs:
            raise UserError(
                f"data.dataset {self.path}: {self.num_pairs} pairs leave none for training after the "
                f"validation split (data.val_fraction = {val_fraction})"
            )
        self.val_ids = np.sort(order[:n_val])
        self.train_ids = np.sort(order[n_val:])

    @property
    def description(self) -> str:
        return f"{len(self.train_ids):,} training pairs ({self.num_tokens:,} tokens)"

    def gather(self, ids: np.ndarray, length: int | None = None) -> TextBatch:
        """The pairs `ids` as one batch padded to `length`, by default the smallest bucket
        that fits."""
        rows = self._rows(ids)
        length = length or self.bucket(max(len(r) for r in rows))
        tokens = torch.zeros(len(rows), length, dtype=torch.long)
        mask = torch.zeros(len(rows), length, dtype=torch.long)
        for j, row in enumerate(rows):
            tokens[j, : len(row)] = torch.from_numpy(row.astype(np.int64))
            mask[j, : len(row)] = 1
        return TextBatch(tokens, mask, self.groups)

    def gather_step(self, ids: list[np.ndarray]) -> list[TextBatch]:
        """A step's micro-batches, all padded to the bucket of the step's longest text: one
        compiled shape per step, so that a step's first micro-batch names its graph."""
        length = self.bucket(max(len(r) for i in ids for r in self._rows(i)))
        return [self.gather(i, length) for i in ids]

    def bucket(self, longest: int) -> int:
        return next(b for b in self.buckets if b >= longest)

    def _rows(self, ids: np.ndarray) -> list[np.ndarray]:
        return [
            self._ids[g][self._starts[g][i] : self._starts[g][i + 1]] for g in range(self.groups) for i in ids.tolist()
        ]
