"""Texts into vectors: sorted by token length, batched by a token budget (many short texts
or few long ones a batch), each batch padded to its longest text only, results back in input
order; a long list in chunks of CHUNK texts (`embed_in_chunks`). What `frugality embed`
(a shard at a time, `inference.shards`), `serve` and the benchmarks run."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from frugality.backends import backend

if TYPE_CHECKING:
    import torch

# (padded tokens, texts) per batch. On a CPU small batches keep an encoder's products in
# cache: all-MiniLM-L6-v2 on WordNet glosses ran 225 texts/s at 2,048 tokens and 64 texts,
# 114 at 16,384 and 512 (2-core EPYC, 2 threads); a GPU wants large ones.
BATCH_DEFAULTS = {"cpu": (2_048, 64), "cuda": (65_536, 1_024)}
CACHE_WIDTH = 384  # the width the CPU budget was measured at (all-MiniLM-L6-v2's)


def batch_defaults(encoder) -> tuple[int, int]:
    """(padded tokens, texts) per batch for `encoder` on its device. On a CPU a model
    narrower than CACHE_WIDTH gets a budget as many times larger as it is narrower (up to 8x):
    the same activations' bytes stay in cache, and each call's fixed costs spread over more
    texts (a one-layer width-32 BERT on 20,000 WordNet glosses, its calls alone: 1.73x the
    texts/s at 4x the budget, 1.96x at 8x, 16,384 tokens and 512 texts, where all-MiniLM-L6-v2
    gained nothing from 1.5x and lost at 4x; 2-core Zen 4, bf16, by hand, 2026-11-28)."""
    tokens, rows = BATCH_DEFAULTS.get(encoder.device.type, BATCH_DEFAULTS["cpu"])
    if backend(encoder.device).on_host:
        scale = min(8, max(1, CACHE_WIDTH // encoder.width))
        tokens, rows = tokens * scale, rows * scale
    return tokens, rows


CHUNK = 16_384  # texts tokenized at once (sorted and batched together: the same batches on every run)


def embed_in_chunks(
    encoder, texts: list[str], batch_tokens: int, max_batch: int, report=lambda n: None
) -> tuple[np.ndarray, int]:
    """`embed_texts` in chunks of CHUNK texts, and how many texts were cut to the model's
    length. On an accelerator the next chunk is tokenized in a thread while the model embeds
    this one (HF tokenizers let go of the GIL as they work). On the CPU each chunk is
    tokenized, then embedded: both take every core, and at once their threads wait on each
    other (2-core Zen 4, 20,000 glosses, a one-layer width-32 BERT in bf16: 24,072 texts/s in
    turn, 20,830 overlapped; MiniLM the same either way, its tokenizing 1% of the time).
    Python's cyclic collector is paused meanwhile (`cyclic_gc_paused`)."""
    with cyclic_gc_paused():
        return _embed_in_chunks(encoder, texts, batch_tokens, max_batch, report)


@contextmanager
def cyclic_gc_paused():
    """Python's cyclic garbage collector off for the block, then as it was. A chunk's token
    ids are tens of thousands of lists, which set off the collector's full passes over every
    object of the process (about 326,000 with torch loaded): 100-200 ms at random points of
    a chunk of 16,384 texts (its tokenizing took 360 ms instead of 225 in half the runs; 2-core
    Zen 4). Nothing in the work makes reference cycles (reference counts free it), so the
    collector waits until the chunks are done."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _embed_in_chunks(encoder, texts: list[str], batch_tokens: int, max_batch: int, report) -> tuple[np.ndarray, int]:
    from concurrent.futures import ThreadPoolExecutor

    chunks = [texts[i : i + CHUNK] for i in range(0, len(texts), CHUNK)]
    parts, cut = [], 0
    if backend(encoder.device).on_host:  # (the model and the tokenizer share the cores)
        for chunk in chunks:
            rows, chunk_cut = encoder.encode(chunk)
            parts.append(embed_rows(encoder, rows, batch_tokens, max_batch, report))
            cut += chunk_cut
    else:
        with ThreadPoolExecutor(1, thread_name_prefix="frugality-tokenizer") as tokenizer:
            coming = tokenizer.submit(encoder.encode, chunks[0]) if chunks else None
            for i in range(len(chunks)):
                assert coming is not None
                rows, chunk_cut = coming.result()
                coming = tokenizer.submit(encoder.encode, chunks[i + 1]) if i + 1 < len(chunks) else None
                parts.append(embed_rows(encoder, rows, batch_tokens, max_batch, report))
                cut += chunk_cut
    return (np.concatenate(parts) if parts else np.empty((0, encoder.dim), dtype=np.float32)), cut


def embed_texts(encoder, texts: list[str], batch_tokens: int, max_batch: int, report=lambda n: None) -> np.ndarray:
    """Embeddings of `texts` in their order, computed longest first in token-budget batches.
    On XLA, whose graphs are compiled per shape, a batch is padded to a length bucket (16,
    32, 64, ... tokens) and filled to that bucket's fixed number of rows: one graph each."""
    return embed_rows(encoder, encoder.tokenize(texts), batch_tokens, max_batch, report)


def in_bulk(device) -> bool:
    """Whether a device's batches are queued and their vectors copied back together: an
    asynchronous accelerator (a GPU), whose host would otherwise wait for every batch. Not
    the CPU (synchronous) nor XLA (a batch's graph runs when its result is read)."""
    return backend(device).asynchronous


def embed_rows(encoder, rows: list[list[int]], batch_tokens: int, max_batch: int, report=lambda n: None) -> np.ndarray:
    """`embed_texts` of texts already tokenized (`encoder.tokenize`)."""
    from frugality.inference.generate import bucket

    # longest first, ties in input order (a stable sort of the negated lengths: the order
    # `sorted(..., reverse=True)` gives, 1.2 ms against its 3.2 for 20,000 texts)
    order = np.argsort(-np.fromiter(map(len, rows), dtype=np.int64, count=len(rows)), kind="stable")
    result = np.empty((len(rows), encoder.dim), dtype=np.float32)
    static, bulk = backend(encoder.device).traced, in_bulk(encoder.device)
    queued: list[tuple[np.ndarray, torch.Tensor]] = []  # (texts, their vectors on the device), when in bulk
    start = 0
    while start < len(order):
        longest = len(rows[order[start]])
        pad_to = bucket(longest, encoder.max_length) if static else min(longest, encoder.max_length)
        fill = max(1, min(max_batch, batch_tokens // pad_to))
        n = min(fill, len(order) - start)
        chosen = order[start : start + n]
        if bulk:
            queued.append((chosen, encoder.embed_tokens_on_device([rows[i] for i in chosen], pad_to)))
        else:
            result[chosen] = encoder.embed_tokens([rows[i] for i in chosen], pad_to, fill if static else n)
        report(n)
        start += n
    if queued:  # one copy back for the whole list (it waits for the device once)
        import torch

        result[np.concatenate([chosen for chosen, _ in queued])] = torch.cat([v for _, v in queued]).cpu().numpy()
    return result
