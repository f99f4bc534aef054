"""Completions with continuous batching: one decoding loop on one static key/value cache of
`rows` rows. A queued prompt joins in a free row between two decoding steps (its prefill
in the prompt-length buckets `frugality generate` compiles, the other rows' tokens
padding that writes nowhere they read), every step decodes all rows at once (one shape),
and a row that ends (an end token, a stop string, `max_tokens`) leaves, its row free for
the next prompt. Greedy rows give `frugality generate`'s tokens."""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import torch

from frugality import xla
from frugality.backends import backend
from frugality.inference.generate import (
    Completion,
    RowText,
    Sampling,
    bucket,
    compiled_steps,
    new_generator,
    pick,
    replays_on_this_thread,
)
from frugality.models.kv_cache import KVCache
from frugality.serve.protocol import APIError, overloaded

_STOP = object()


@dataclass
class _Sequence:
    prompt: list[int]
    sampling: Sampling
    future: PromptFuture
    on_text: Callable[[str], None] | None
    arrived: float = field(default_factory=time.perf_counter)
    completion: Completion = field(default_factory=Completion)
    text: RowText | None = None
    generator: torch.Generator | None = None
    abandoned: bool = False  # its client is gone: its row is freed at the next step


class PromptFuture(Future):
    """A prompt's completion to come; it knows its sequence (`abandon` marks it)."""

    sequence: _Sequence


def settle(future: Future, result=None, error: BaseException | None = None) -> None:
    """Resolve a future that its client may have cancelled meanwhile (then: nothing)."""
    with contextlib.suppress(InvalidStateError):
        future.set_exception(error) if error is not None else future.set_result(result)


class CompletionService:
    endpoint = "completions"

    def __init__(
        self,
        decoder,
        metrics,
        max_wait_ms: float,
        max_queue: int,
        rows: int,
        context: int,
        compile: str | None = None,  # a torch.compile backend: `frugality generate --compile`'s graphs
    ):
        self.decoder, self.metrics, self.max_wait = decoder, metrics, max_wait_ms / 1000
        self.context = min(context, decoder.max_seq_len)
        self.cache = KVCache.for_model(decoder.model, rows, self.context)
        self.prefill, self.decode, self.replays = compiled_steps(decoder, self.cache, compile)
        self.pad_id = decoder.eos_ids[0] if decoder.eos_ids else 0
        self.slots: list[_Sequence | None] = [None] * rows
        self.last = torch.full((rows,), self.pad_id, dtype=torch.long)  # each row's latest token
        self.following = torch.full((rows,), -1, dtype=torch.long)  # the position it takes when fed; -1: free
        self.max_queue = max_queue
        self._queue: queue.Queue = queue.Queue()
        self._waiting = 0  # prompts queued, counted under the lock: a request's prompts go in all or none
        self._lock = threading.Lock()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="frugality-completions", daemon=True)
        self._thread.start()

    def tokenize(self, prompts: list[str], max_tokens: int) -> list[list[int]]:
        rows = self.decoder.encode(prompts)
        for i, row in enumerate(rows):
            if not row:
                raise APIError(400, f"'prompt[{i}]' has no tokens", "prompt")
            if len(row) + max_tokens - 1 > self.context:
                raise APIError(
                    400,
                    f"'prompt[{i}]' is {len(row)} tokens; with max_tokens {max_tokens} it exceeds the "
                    f"{self.context} positions this server holds a row",
                    "prompt",
                )
        return rows

    def submit_all(self, asks: list[tuple[list[int], Sampling, Callable[[str], None] | None]]) -> list[PromptFuture]:
        """Queue a request's prompts, all of them or (the queue full) none: a 503."""
        sequences = [_Sequence(prompt, sampling, PromptFuture(), on_text) for prompt, sampling, on_text in asks]
        if len(sequences) > self.max_queue:  # could never be queued: not a 503 to retry
            raise APIError(
                400, f"'prompt' holds {len(sequences)} prompts; this server queues at most {self.max_queue}", "prompt"
            )
        with self._lock:
            if self._closing or self._waiting + len(sequences) > self.max_queue:
                raise overloaded()
            self._waiting += len(sequences)
            for s in sequences:
                s.future.sequence = s  # (abandon() finds it)
                self._queue.put_nowait(s)
        self.metrics.depth.labels(self.endpoint).set(self._waiting)
        return [s.future for s in sequences]

    def submit(
        self, prompt: list[int], sampling: Sampling, on_text: Callable[[str], None] | None = None
    ) -> PromptFuture:
        return self.submit_all([(prompt, sampling, on_text)])[0]

    @staticmethod
    def abandon(futures: list[PromptFuture]) -> None:
        """The client is gone: queued prompts are skipped, decoding rows freed."""
        for f in futures:
            f.sequence.abandoned = True
            f.cancel()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop: what is still queued or decoding has no client left (the HTTP server
        drained first), so it is dropped."""
        with self._lock:
            self._closing = True
        self._queue.put_nowait(_STOP)
        self._thread.join(timeout_s)

    @torch.inference_mode()
    def _loop(self) -> None:
        if self.replays:  # (the compiled step's CUDA graphs run on this thread)
            replays_on_this_thread()
        while True:
            try:
                if self._turn():
                    return
            except Exception as e:  # a fault of ours outside the model calls: what is in flight hears it
                for slot, s in enumerate(self.slots):
                    if s is not None:
                        settle(s.future, error=e)
                        self._free(slot)

    def _turn(self) -> bool:
        """Admit, prefill and decode one step; True once the service is closed."""
        if self._closing:
            self._drop_everything()
            return True
        busy = any(s is not None for s in self.slots)
        joining = self._admit(wait=not busy)
        if joining is None:  # (closing)
            return False
        for slot, s in enumerate(self.slots):
            if s is not None and s.abandoned:
                self._free(slot)
        joined = []
        try:
            if joining:
                joined = self._join(joining)
        except Exception as e:  # the prefill failed: the rows joining hear so
            for _, s in joined or joining:
                settle(s.future, error=e)
            for slot, _ in joining:
                self._free(slot)
        try:
            if any(s is not None for s in self.slots):
                self._step()
        except Exception as e:  # the decoding step failed: every row in it hears so, the loop goes on
            for slot, s in enumerate(self.slots):
                if s is not None:
                    settle(s.future, error=e)
                    self._free(slot)
        return False

    def _admit(self, wait: bool) -> list[tuple[int, _Sequence]] | None:
        """Queued prompts for the free rows: when idle, wait for one, then `max_wait` for
        more; while decoding, only those already queued. None: the service is closing."""
        free = [i for i, s in enumerate(self.slots) if s is None]
        joining: list[tuple[int, _Sequence]] = []
        deadline = None
        while len(joining) < len(free):
            try:
                if wait and not joining:
                    item = self._queue.get()
                    deadline = time.perf_counter() + self.max_wait
                elif deadline is not None:
                    item = self._queue.get(timeout=max(0.0, deadline - time.perf_counter()))
                else:
                    item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                if joining:
                    self._queue.put_nowait(_STOP)  # seen again once these have joined
                    break
                return None
            with self._lock:
                self._waiting -= 1
            if item.abandoned or not item.future.set_running_or_notify_cancel():
                continue  # its client left while it waited
            joining.append((free[len(joining)], item))
        self.metrics.depth.labels(self.endpoint).set(self._waiting)
        return joining

    def _join(self, joining: list[tuple[int, _Sequence]]) -> list[tuple[int, _Sequence]]:
        """Prefill the prompts joining into their rows; those whose setting up failed hear
        so and stay out. Returns those that joined."""
        now = time.perf_counter()
        rows = len(self.slots)
        joined = []
        for slot, s in joining:
            try:
                s.text = RowText(
                    self.decoder, s.sampling, (lambda row, piece, f=s.on_text: f(piece)) if s.on_text else None
                )
                s.generator = new_generator(self.decoder.device, s.sampling.seed)
            except Exception as e:
                settle(s.future, error=e)
                continue
            self.metrics.queued.labels(self.endpoint).observe(now - s.arrived)
            joined.append((slot, s))
        if not joined:
            return joined
        width = bucket(max(len(s.prompt) for _, s in joined), self.decoder.max_seq_len)
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        positions = torch.full((rows, width), -1, dtype=torch.long)  # the rows decoding: padding, written nowhere
        for slot, s in joined:
            ids[slot, width - len(s.prompt) :] = torch.tensor(s.prompt)
            positions[slot, width - len(s.prompt) :] = torch.arange(len(s.prompt))
            self.slots[slot] = s
            self.following[slot] = len(s.prompt) - 1  # its prompt's last; the token picked next takes + 1
        device = self.decoder.device
        logits = self._host(self.prefill(self.decoder.model, ids.to(device), positions.to(device), self.cache))
        self.metrics.batch.labels(f"{self.endpoint}-prefill").observe(len(joined))
        self.metrics.tokens.labels(self.endpoint, "prompt").inc(sum(len(s.prompt) for _, s in joined))
        for slot, _ in joined:
            self._take(slot, logits[slot : slot + 1])
        return joined

    def _step(self) -> None:
        device = self.decoder.device
        active = [i for i, s in enumerate(self.slots) if s is not None]
        if self.replays:  # a new step: the last replay's logits were read
            torch.compiler.cudagraph_mark_step_begin()
        logits = self._host(
            self.decode(
                self.decoder.model, self.last[:, None].to(device), self.following[:, None].to(device), self.cache
            )
        )
        self.metrics.batch.labels(self.endpoint).observe(len(active))
        for slot in active:
            self._take(slot, logits[slot : slot + 1])

    def _take(self, slot: int, logits: torch.Tensor) -> None:
        """The row's next token from its logits: appended, and the row ended if it ends;
        a failure here is this row's alone."""
        s = self.slots[slot]
        assert s is not None and s.text is not None  # a row in use, set up by _join
        try:
            token = int(pick(logits, s.sampling, s.generator)[0])
            ended = s.text.add(0, s.completion, token)
            self.metrics.tokens.labels(self.endpoint, "completion").inc()
            if ended or len(s.completion.tokens) >= s.sampling.max_new_tokens:
                s.text.finish(0, s.completion)
                settle(s.future, s.completion)
                self._free(slot)
                return
        except Exception as e:
            settle(s.future, error=e)
            self._free(slot)
            return
        self.last[slot] = token
        self.following[slot] += 1

    def _host(self, logits: torch.Tensor) -> torch.Tensor:
        """On XLA: the step's graph ended (the cache written) and the logits on the host,
        where the rows sample, as `generate` does; elsewhere as they are."""
        if not backend(self.decoder.device).traced:
            return logits
        xla.sync()
        return logits.cpu()

    def _free(self, slot: int) -> None:
        self.slots[slot] = None
        self.last[slot] = self.pad_id
        self.following[slot] = -1

    def _drop_everything(self) -> None:
        gone = RuntimeError("the server stopped")
        for slot, s in enumerate(self.slots):
            if s is not None:
                settle(s.future, error=gone)
                self._free(slot)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                settle(item.future, error=gone)


def sampling_for(request, decoder, index: int = 0) -> Sampling:
    """A prompt's sampling: greedy at temperature 0 (or one too small to divide by); the
    request's seed plus the prompt's index, else a random one: each prompt its own draws."""
    seed = (request.seed + index) % 2**63 if request.seed is not None else random.randrange(2**63)
    return Sampling(
        max_new_tokens=request.max_tokens,
        temperature=request.temperature if request.temperature >= 1e-5 else 0.0,
        top_p=request.top_p,
        seed=seed,
        stop_ids=decoder.eos_ids,
        stop_strings=request.stop,
    )
