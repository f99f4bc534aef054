"""Completions with continuous batching: one decoding loop on one static key/value cache of
`rows` rows. A queued prompt joins in a free row between two decoding steps (its prefill
in the prompt-length buckets `frugality generate` compiles, the other rows' tokens
padding that writes nowhere they read), every step decodes all rows at once (one shape),
and a row that ends (an end token, a stop string, `max_tokens`) leaves, its row free for
the next prompt. Greedy rows give `frugality generate`'s tokens."""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from frugality.inference.generate import (
    Completion,
    RowText,
    Sampling,
    _decode,
    _prefill,
    bucket,
    new_generator,
    pick,
)
from frugality.models.kv_cache import KVCache
from frugality.serve.protocol import APIError, overloaded

_STOP = object()


@dataclass
class _Sequence:
    prompt: list[int]
    sampling: Sampling
    future: Future
    on_text: Callable[[str], None] | None
    arrived: float = field(default_factory=time.perf_counter)
    completion: Completion = field(default_factory=Completion)
    text: RowText | None = None
    generator: torch.Generator | None = None


class CompletionService:
    endpoint = "completions"

    def __init__(self, decoder, metrics, max_wait_ms: float, max_queue: int, rows: int, context: int):
        self.decoder, self.metrics, self.max_wait = decoder, metrics, max_wait_ms / 1000
        self.context = min(context, decoder.max_seq_len)
        self.cache = KVCache.for_model(decoder.model, rows, self.context)
        self.pad_id = decoder.eos_ids[0] if decoder.eos_ids else 0
        self.slots: list[_Sequence | None] = [None] * rows
        self.last = torch.full((rows,), self.pad_id, dtype=torch.long)  # each row's latest token
        self.following = torch.full((rows,), -1, dtype=torch.long)  # the position it takes when fed; -1: free
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
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

    def submit(self, prompt: list[int], sampling: Sampling, on_text: Callable[[str], None] | None = None) -> Future:
        sequence = _Sequence(prompt, sampling, Future(), on_text)
        try:
            self._queue.put_nowait(sequence)
        except queue.Full:
            raise overloaded() from None
        self.metrics.depth.labels(self.endpoint).set(self._queue.qsize())
        return sequence.future

    def close(self) -> None:
        self._queue.put(_STOP)  # after what is queued: what is queued and decoding finishes first
        self._thread.join()

    @torch.inference_mode()
    def _loop(self) -> None:
        stopping = False
        while True:
            busy = any(s is not None for s in self.slots)
            if not busy and stopping:
                return
            joining = self._admit(wait=not busy and not stopping)
            if joining is _STOP:
                stopping = True
                continue
            try:
                if joining:
                    self._join(joining)
                if any(s is not None for s in self.slots):
                    self._step()
            except Exception as e:  # the model failed: the rows in it hear so, the loop goes on
                for i, s in enumerate(self.slots):
                    if s is not None:
                        s.future.set_exception(e)
                        self._free(i)

    def _admit(self, wait: bool):
        """Queued prompts for the free rows: when idle, wait for one, then `max_wait` for
        more; while decoding, only those already queued."""
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
                    self._queue.put(_STOP)  # seen again once these have joined
                    break
                return _STOP
            joining.append((free[len(joining)], item))
        self.metrics.depth.labels(self.endpoint).set(self._queue.qsize())
        return joining

    def _join(self, joining: list[tuple[int, _Sequence]]) -> None:
        now = time.perf_counter()
        width = bucket(max(len(s.prompt) for _, s in joining), self.decoder.max_seq_len)
        rows = len(self.slots)
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        positions = torch.full((rows, width), -1, dtype=torch.long)  # the rows decoding: padding, written nowhere
        for slot, s in joining:
            self.metrics.queued.labels(self.endpoint).observe(now - s.arrived)
            ids[slot, width - len(s.prompt) :] = torch.tensor(s.prompt)
            positions[slot, width - len(s.prompt) :] = torch.arange(len(s.prompt))
            s.text = RowText(
                self.decoder, s.sampling, (lambda row, piece, f=s.on_text: f(piece)) if s.on_text else None
            )
            s.generator = new_generator(self.decoder.device, s.sampling.seed)
            self.slots[slot] = s
            self.following[slot] = len(s.prompt) - 1  # its prompt's last; the token picked next takes + 1
        device = self.decoder.device
        logits = _prefill(self.decoder.model, ids.to(device), positions.to(device), self.cache)
        self.metrics.batch.labels(f"{self.endpoint}-prefill").observe(len(joining))
        self.metrics.tokens.labels(self.endpoint, "prompt").inc(sum(len(s.prompt) for _, s in joining))
        for slot, _ in joining:
            self._take(slot, logits[slot : slot + 1])

    def _step(self) -> None:
        device = self.decoder.device
        active = [i for i, s in enumerate(self.slots) if s is not None]
        logits = _decode(
            self.decoder.model, self.last[:, None].to(device), self.following[:, None].to(device), self.cache
        )
        self.metrics.batch.labels(self.endpoint).observe(len(active))
        for slot in active:
            self._take(slot, logits[slot : slot + 1])

    def _take(self, slot: int, logits: torch.Tensor) -> None:
        """The row's next token from its logits: appended, and the row ended if it ends."""
        s = self.slots[slot]
        token = int(pick(logits, s.sampling, s.generator)[0])
        ended = s.text.add(0, s.completion, token)
        self.metrics.tokens.labels(self.endpoint, "completion").inc()
        if ended or len(s.completion.tokens) >= s.sampling.max_new_tokens:
            s.text.finish(0, s.completion)
            s.future.set_result(s.completion)
            self._free(slot)
            return
        self.last[slot] = token
        self.following[slot] += 1

    def _free(self, slot: int) -> None:
        self.slots[slot] = None
        self.last[slot] = self.pad_id
        self.following[slot] = -1


def sampling_for(request, decoder) -> Sampling:
    """A request's sampling: greedy at temperature 0; a seed of its own, else a random one."""
    seed = request.seed if request.seed is not None else random.randrange(2**63)
    return Sampling(
        max_new_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=seed,
        stop_ids=decoder.eos_ids,
        stop_strings=request.stop,
    )
