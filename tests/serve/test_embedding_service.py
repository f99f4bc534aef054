"""The embeddings service's threads (frugality.serve.embeddings) with a real encoder (a
BERT of one layer and width 32 with all-MiniLM-L6-v2's tokenizer): batching, the token
budget's carry-over, a client that left, the bounded queue, closing with work queued, and
each request's own vectors throughout."""

from __future__ import annotations

import time

import numpy as np
import pytest

from frugality.inference.batches import embed_texts
from frugality.serve.protocol import APIError


@pytest.fixture(scope="module")
def encoder(near_zero_encoder):
    return near_zero_encoder


def _service(encoder, max_wait_ms=0.0, max_queue=64, batch_tokens=2048):
    from frugality.serve.embeddings import EmbeddingService
    from frugality.serve.metrics import ServeMetrics

    metrics = ServeMetrics()
    return EmbeddingService(encoder, metrics, max_wait_ms, max_queue, batch_tokens, 64), metrics


def _calls(metrics) -> float:
    return metrics.registry.get_sample_value("frugality_batch_rows_count", {"endpoint": "embeddings"}) or 0.0


TEXTS = [f"request {i} about a {'long ' * (i % 7)}topic" for i in range(12)]


def test_an_idle_model_waits_for_company_only_when_asked_and_each_request_gets_its_own_rows(encoder):
    reference = embed_texts(encoder, TEXTS, 2048, 64)
    service, metrics = _service(encoder, max_wait_ms=300)
    try:
        futures = [service.submit([t]) for t in TEXTS]  # within the first's 300 ms
        answers = [f.result(timeout=30) for f in futures]
    finally:
        service.close()
    assert _calls(metrics) == 1  # one model call for all twelve
    for answer, want in zip(answers, reference, strict=True):
        np.testing.assert_allclose(answer.vectors[0], want, rtol=1e-5, atol=1e-6)
        assert answer.cut == 0 and answer.tokens > 0
    assert service._waiting == 0


def test_a_batch_past_the_token_budget_leaves_the_rest_for_the_next_call(encoder):
    service, metrics = _service(encoder, max_wait_ms=300, batch_tokens=12)  # about one text a call
    try:
        futures = [service.submit([t]) for t in TEXTS[:6]]
        answers = [f.result(timeout=30) for f in futures]
    finally:
        service.close()
    reference = embed_texts(encoder, TEXTS[:6], 2048, 64)
    assert _calls(metrics) >= 5  # (the first call may hold two short texts)
    for answer, want in zip(answers, reference, strict=True):
        np.testing.assert_allclose(answer.vectors[0], want, rtol=1e-5, atol=1e-6)


def test_a_full_queue_is_refused_at_once_and_a_client_that_left_frees_its_place(encoder):
    service, _ = _service(encoder, max_wait_ms=500, max_queue=2)
    try:
        first, second = service.submit([TEXTS[0]]), service.submit([TEXTS[1]])
        with pytest.raises(APIError) as refused:
            service.submit([TEXTS[2]])  # both still waiting (the model waits 500 ms for company)
        assert refused.value.status == 503 and refused.value.headers["Retry-After"] == "1"
        assert second.cancel()  # its client left before the batch ran
        assert first.result(timeout=30).vectors.shape == (1, encoder.dim)
        deadline = time.monotonic() + 10
        while service._waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        assert service._waiting == 0  # the cancelled one no longer holds a place
        assert service.submit([TEXTS[3]]).result(timeout=30).vectors.shape == (1, encoder.dim)
    finally:
        service.close()


def test_closing_answers_what_was_queued_and_refuses_what_comes_after(encoder):
    service, _ = _service(encoder, max_wait_ms=100)
    futures = [service.submit([t, t]) for t in TEXTS[:4]]
    service.close()
    assert all(f.result(timeout=1).vectors.shape == (2, encoder.dim) for f in futures)
    with pytest.raises(APIError):
        service.submit(["after the end"])


def test_streams_share_the_batches_each_on_its_share_of_the_threads_and_close_together(encoder, monkeypatch):
    import threading

    import torch

    import frugality.serve.embeddings as embeddings

    seen: list[tuple[str, int]] = []  # (the thread, its torch threads) of each model call
    real = embeddings.embed_rows

    def recorded(*args, **kwargs):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        time.sleep(0.02)  # (a call long enough that the other stream takes the next request)
        return real(*args, **kwargs)

    monkeypatch.setattr(embeddings, "embed_rows", recorded)
    reference = embed_texts(encoder, TEXTS, 2048, 64)
    cores = torch.get_num_threads()
    from frugality.serve.embeddings import EmbeddingService
    from frugality.serve.metrics import ServeMetrics

    service = EmbeddingService(encoder, ServeMetrics(), 0.0, 64, 2048, 64, streams=2)
    assert service.streams_line == f"; 2 streams of {max(1, cores // 2)} thread{'s' * (cores // 2 > 1)}"
    warm = len(seen)
    assert warm == 2 and {name for name, _ in seen} == {"frugality-embeddings-0", "frugality-embeddings-1"}
    try:
        futures = []
        for t in TEXTS:
            futures.append(service.submit([t]))
            time.sleep(0.005)
        answers = [f.result(timeout=30) for f in futures]
    finally:
        service.close()
    for answer, want in zip(answers, reference, strict=True):
        np.testing.assert_allclose(answer.vectors[0], want, rtol=1e-5, atol=1e-6)
    assert {name for name, _ in seen[warm:]} == {"frugality-embeddings-0", "frugality-embeddings-1"}
    assert {threads for _, threads in seen} == {max(1, cores // 2)}
    assert torch.get_num_threads() == cores  # (this thread's own count is untouched)
    assert not any(thread.is_alive() for thread in service._threads)  # both streams ended at close
