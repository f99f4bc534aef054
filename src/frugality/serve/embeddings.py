"""Embeddings with dynamic batching: a request's texts are tokenized as it arrives and
queued; one model thread takes the oldest request, then whatever else arrives within
`max_wait_ms` of it up to a token budget, and embeds them together longest first in the
batches `frugality embed` makes (`inference.embed.embed_rows`); each request gets its own
rows back. The queue is bounded: a request that finds it full is refused (503) at once,
never held in an unbounded backlog."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from frugality.inference.embed import embed_rows
from frugality.serve.completions import settle
from frugality.serve.protocol import overloaded

_STOP = object()


@dataclass
class _Pending:
    rows: list[list[int]]
    future: Future
    arrived: float = field(default_factory=time.perf_counter)

    @property
    def tokens(self) -> int:
        return sum(map(len, self.rows))


class EmbeddingService:
    endpoint = "embeddings"

    def __init__(self, encoder, metrics, max_wait_ms: float, max_queue: int, batch_tokens: int, max_batch: int):
        self.encoder, self.metrics = encoder, metrics
        self.max_wait = max_wait_ms / 1000
        self.batch_tokens, self.max_batch = batch_tokens, max_batch
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="frugality-embeddings", daemon=True)
        self._thread.start()

    def tokenize(self, texts: list[str]) -> tuple[list[list[int]], int]:
        """The texts' token rows, each cut to the encoder's length (as `embed` cuts them, and
        sentence-transformers), and how many were cut: counted in /metrics."""
        rows, cut = self.encoder.encode(texts)
        if cut:
            self.metrics.truncated.labels(self.endpoint).inc(cut)
        return rows, cut

    def submit(self, rows: list[list[int]]) -> Future:
        pending = _Pending(rows, Future())
        try:
            self._queue.put_nowait(pending)
        except queue.Full:
            raise overloaded() from None
        self.metrics.depth.labels(self.endpoint).set(self._queue.qsize())
        return pending.future

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop: what is still queued has no client left (the HTTP server drained first)."""
        self._closing = True
        with contextlib.suppress(queue.Full):  # the loop sees the flag after its batch
            self._queue.put_nowait(_STOP)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP or self._closing:
                return
            batch, tokens, stop = [first], first.tokens, False
            deadline = first.arrived + self.max_wait
            while tokens < self.batch_tokens:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.perf_counter()))
                except queue.Empty:
                    break
                if item is _STOP:
                    stop = True
                    break
                batch.append(item)
                tokens += item.tokens
            self.metrics.depth.labels(self.endpoint).set(self._queue.qsize())
            self._run(batch)
            if stop:
                return

    def _run(self, batch: list[_Pending]) -> None:
        batch = [p for p in batch if p.future.set_running_or_notify_cancel()]  # (a client that left: skipped)
        if not batch:
            return
        started = time.perf_counter()
        for p in batch:
            self.metrics.queued.labels(self.endpoint).observe(started - p.arrived)
        rows = [row for p in batch for row in p.rows]
        calls: list[int] = []
        try:
            vectors = embed_rows(self.encoder, rows, self.batch_tokens, self.max_batch, report=calls.append)
        except Exception as e:  # the model failed: each request hears it, the thread goes on
            for p in batch:
                settle(p.future, error=e)
            return
        for n in calls:
            self.metrics.batch.labels(self.endpoint).observe(n)
        self.metrics.tokens.labels(self.endpoint, "prompt").inc(sum(map(len, rows)))
        at = 0
        for p in batch:
            settle(p.future, np.asarray(vectors[at : at + len(p.rows)]))
            at += len(p.rows)
