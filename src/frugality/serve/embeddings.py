"""Embeddings with continuous batching, in three stages as TEI and infinity-emb run them:
the event loop queues each request's texts; a tokenizer thread takes everything queued and
tokenizes it in one call (HF tokenizers release the GIL while they work), while the model
runs; the model thread takes every tokenized request up to a token budget and embeds them
together, longest first, in the batches `frugality embed` makes (`inference.batches.embed_rows`).
An idle model takes what is there and goes (no timed wait unless `max_wait_ms` asks for
one); requests that arrive while a batch runs make the next one. The queue is bounded: a
request that finds it full is refused (503) at once, never held in an unbounded backlog.

On a CPU, `streams` threads may run batches at once, each on its share of the cores (as
OpenVINO's CPU streams and `embed --nproc` split them): the model thread forms a batch
whenever a stream is free and hands it over. Each call then waits on fewer threads, and a
batch is formed while others run; a lone request runs on fewer cores."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from frugality.inference.batches import embed_rows
from frugality.serve.completions import settle
from frugality.serve.protocol import Embedded, overloaded

_STOP = object()


@dataclass
class _Pending:
    texts: list[str]
    future: Future
    arrived: float = field(default_factory=time.perf_counter)
    rows: list[list[int]] = field(default_factory=list)
    cut: int = 0

    @property
    def tokens(self) -> int:
        return sum(map(len, self.rows))


class EmbeddingService:
    endpoint = "embeddings"

    def __init__(
        self,
        encoder,
        metrics,
        max_wait_ms: float,
        max_queue: int,
        batch_tokens: int,
        max_batch: int,
        streams: int = 1,
    ):
        self.encoder, self.metrics = encoder, metrics
        self.max_wait = max_wait_ms / 1000
        self.batch_tokens, self.max_batch, self.max_queue = batch_tokens, max_batch, max_queue
        self._texts: queue.SimpleQueue = queue.SimpleQueue()  # to the tokenizer thread
        self._rows: queue.SimpleQueue = queue.SimpleQueue()  # to the model thread
        self._waiting, self._lock = 0, threading.Lock()  # requests queued in either
        self._closing = False
        self.streams = streams
        self._free = threading.Semaphore(streams)  # streams not running a batch
        self._batches: queue.SimpleQueue = queue.SimpleQueue()  # the model thread's batches, to the streams
        self._threads = [
            threading.Thread(target=self._tokenize_loop, name="frugality-tokenizer", daemon=True),
            threading.Thread(target=self._model_loop, name="frugality-embeddings", daemon=True),
        ]
        self.streams_line = ""
        if streams > 1:
            self._start_streams(streams)
        for thread in self._threads[:2]:
            thread.start()

    def _start_streams(self, streams: int) -> None:
        """The streams, each warmed (its first call is its slowest: made before any request's),
        then torch's thread count for threads yet to start put back as it was."""
        cores = torch.get_num_threads()
        # every core to a stream: the first `cores % streams` take one more (the server refuses
        # more streams than threads)
        shares = [max(1, cores // streams + (i < cores % streams)) for i in range(streams)]
        each = "-".join(map(str, sorted(set(shares))))
        self.streams_line = f"; {streams} streams of {each} thread{'s' * (shares != [1] * streams)}"
        warmed, failed = [threading.Event() for _ in range(streams)], []
        for i in range(streams):
            stream = threading.Thread(
                target=self._stream, args=(shares[i], warmed[i], failed), name=f"frugality-stream-{i}", daemon=True
            )
            stream.start()
            self._threads.append(stream)
        for event in warmed:
            event.wait()
        torch.set_num_threads(cores)
        if failed:
            for _ in range(streams):
                self._batches.put(_STOP)
            raise failed[0]

    def submit(self, texts: list[str]) -> Future:
        """The request's `Embedded`, once its batch has run; a full queue is a 503 now."""
        pending = _Pending(texts, Future())
        with self._lock:  # (the check and the put together: nothing lands behind close's marker)
            if self._waiting >= self.max_queue or self._closing:
                raise overloaded()
            self._waiting += 1
            self._texts.put(pending)
        self.metrics.depth.labels(self.endpoint).set(self._waiting)
        return pending.future

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop: what is still queued has no client left (the HTTP server drained first)."""
        with self._lock:
            self._closing = True
            self._texts.put(_STOP)  # through the tokenizer, the model thread, then each stream
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _tokenize_loop(self) -> None:
        while True:
            taken = _take_all(self._texts)
            stop = taken[-1] is _STOP
            batch: list[_Pending] = [p for p in taken if p is not _STOP]
            if batch:
                texts = [t for p in batch for t in p.texts]
                try:
                    rows, cut = self.encoder.encode_each(texts)
                except Exception:  # a text the tokenizer refuses: each request alone, so only its own fails
                    for p in batch:
                        self._tokenize_alone(p)
                else:
                    at = 0
                    for p in batch:
                        p.rows, p.cut = rows[at : at + len(p.texts)], sum(cut[at : at + len(p.texts)])
                        at += len(p.texts)
                        self._rows.put(p)
            if stop:
                self._rows.put(_STOP)
                return

    def _tokenize_alone(self, p: _Pending) -> None:
        try:
            p.rows, cut = self.encoder.encode_each(p.texts)
        except Exception as e:
            self._taken([p])
            settle(p.future, error=e)
            return
        p.cut = sum(cut)
        self._rows.put(p)

    def _model_loop(self) -> None:
        """Batches: each formed once a stream is free (requests that arrive meanwhile make the
        next), run here or, with streams, by the stream that is free."""
        carried: list = []  # what the last batch's budget left out
        streams = self.streams > 1
        while True:
            self._free.acquire()
            taken = carried or [self._rows.get()]
            if self.max_wait and not carried:  # asked to wait for company when idle
                deadline = taken[0].arrived + self.max_wait if taken[0] is not _STOP else 0.0
                while (left := deadline - time.perf_counter()) > 0 and _tokens(taken) < self.batch_tokens:
                    try:
                        taken.append(self._rows.get(timeout=left))
                    except queue.Empty:
                        break
                    if taken[-1] is _STOP:
                        break
            taken += _take_all(self._rows, block=False)
            batch, tokens, carried = [], 0, []
            for item in taken:
                if item is _STOP or carried or (batch and tokens + item.tokens > self.batch_tokens):
                    carried.append(item)
                else:
                    batch.append(item)
                    tokens += item.tokens
            if batch and streams:
                self._batches.put(batch)  # (the stream frees its place when it is done)
            else:
                try:
                    if batch:
                        self._run(batch)
                finally:
                    self._free.release()
            if carried and carried[0] is _STOP:
                for _ in range(self.streams if streams else 0):
                    self._batches.put(_STOP)
                return

    def _stream(self, threads: int, warmed: threading.Event, failed: list) -> None:
        """A stream: its own torch thread count (fixed in this thread before it is set: a thread
        takes the process's count at its first call, after which it keeps its own), its warm-up,
        then the batches the model thread hands it."""
        try:
            torch.get_num_threads()
            torch.set_num_threads(threads)
            embed_rows(self.encoder, self.encoder.encode_each(["warm-up"])[0], self.batch_tokens, self.max_batch)
        except Exception as e:  # (raised by the service's constructor: the server says it in one line)
            failed.append(e)
        finally:
            warmed.set()
        while (batch := self._batches.get()) is not _STOP:
            try:
                self._run(batch)
            finally:
                self._free.release()

    def _run(self, batch: list[_Pending]) -> None:
        started = time.perf_counter()
        self._taken(batch)  # (no longer waiting: --max-queue counts those not yet taken)
        live = []
        for p in batch:
            if p.future.set_running_or_notify_cancel():  # (False: a client that left)
                live.append(p)
                self.metrics.queued.labels(self.endpoint).observe(started - p.arrived)
        if not live:
            return
        rows = [row for p in live for row in p.rows]
        calls: list[int] = []
        try:
            vectors = embed_rows(self.encoder, rows, self.batch_tokens, self.max_batch, report=calls.append)
        except Exception as e:  # the model failed: each request hears it, the thread goes on
            for p in live:
                settle(p.future, error=e)
            return
        for n in calls:
            self.metrics.batch.labels(self.endpoint).observe(n)
        self.metrics.tokens.labels(self.endpoint, "prompt").inc(sum(map(len, rows)))
        truncated = sum(p.cut for p in live)
        if truncated:
            self.metrics.truncated.labels(self.endpoint).inc(truncated)
        at = 0
        for p in live:
            settle(p.future, Embedded(vectors[at : at + len(p.rows)], p.tokens, p.cut))
            at += len(p.rows)

    def _taken(self, items: list[_Pending]) -> None:
        with self._lock:
            self._waiting -= len(items)
            waiting = self._waiting
        self.metrics.depth.labels(self.endpoint).set(waiting)


def _take_all(source: queue.SimpleQueue, block: bool = True, most: int = 1_024) -> list:
    """What `source` holds (waiting for a first item if `block`), up to a stop marker, at most
    `most` items (more wait for the next call)."""
    taken = [source.get()] if block else []
    while (not taken or taken[-1] is not _STOP) and len(taken) < most:
        try:
            taken.append(source.get_nowait())
        except queue.Empty:
            break
    return taken


def _tokens(items: list) -> int:
    return sum(p.tokens for p in items if p is not _STOP)
