"""The embeddings service's threads (frugality.serve.embeddings) with a real encoder (a
BERT of one layer and width 32 with all-MiniLM-L6-v2's tokenizer): batching, the token
budget's carry-over, a client that left, the bounded queue, closing with work queued,
streams (`--streams`: at once, their threads, a failed warm-up), and each request's own
vectors throughout."""

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


def test_streams_run_batches_at_once_each_on_its_share_of_the_threads_and_close_together(encoder, monkeypatch):
    import threading

    import torch

    import frugality.serve.embeddings as embeddings
    from frugality.serve.embeddings import EmbeddingService
    from frugality.serve.metrics import ServeMetrics

    seen: list[tuple[str, int]] = []  # (the thread, its torch threads) of each model call
    together = threading.Barrier(2, timeout=30)  # the first two requests' calls wait for each other
    real = embeddings.embed_rows

    def recorded(encoder, rows, *args, **kwargs):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        if len(seen) in (3, 4):  # the first two requests' calls (after both warm-ups)
            together.wait()  # (broken, and the test failed, if one had to end before the other began)
        return real(encoder, rows, *args, **kwargs)

    monkeypatch.setattr(embeddings, "embed_rows", recorded)
    reference = embed_texts(encoder, TEXTS, 2048, 64)
    before = torch.get_num_threads()
    torch.set_num_threads(4)  # (two streams of two, whatever this machine's cores)
    try:
        service = EmbeddingService(encoder, ServeMetrics(), 0.0, 64, 2048, 64, streams=2)
        assert torch.get_num_threads() == 4  # this thread's count, and the process's, as they were
        assert service.streams_line == "; 2 streams of 2 threads"
        assert sorted(name for name, _ in seen) == ["frugality-stream-0", "frugality-stream-1"]  # warmed
        try:
            first = service.submit([TEXTS[0]])
            deadline = time.monotonic() + 30
            while len(seen) < 3 and time.monotonic() < deadline:  # (its call begun: the next is a batch of its own)
                time.sleep(0.001)
            second = service.submit([TEXTS[1]])  # taken by the other stream while the first's call waits
            answers = [first.result(timeout=30), second.result(timeout=30)]
            answers += [service.submit([t]).result(timeout=30) for t in TEXTS[2:]]
        finally:
            service.close()
    finally:
        torch.set_num_threads(before)
    for answer, want in zip(answers, reference, strict=True):
        np.testing.assert_allclose(answer.vectors[0], want, rtol=1e-5, atol=1e-6)
    assert {name for name, _ in seen[2:4]} == {"frugality-stream-0", "frugality-stream-1"}  # at once
    assert {threads for _, threads in seen} == {2}
    assert not any(thread.is_alive() for thread in service._threads)  # every stream ended at close


def test_a_stream_that_fails_its_warm_up_fails_the_service_and_leaves_no_thread(encoder, monkeypatch):
    import threading

    import frugality.serve.embeddings as embeddings
    from frugality.serve.embeddings import EmbeddingService
    from frugality.serve.metrics import ServeMetrics

    def failing(*args, **kwargs):
        raise RuntimeError("the model failed")

    monkeypatch.setattr(embeddings, "embed_rows", failing)
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="the model failed"):
        EmbeddingService(encoder, ServeMetrics(), 0.0, 64, 2048, 64, streams=2)
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(threading.enumerate()) - before


def test_streams_share_every_core_the_first_ones_taking_the_rest(encoder, monkeypatch):
    import threading

    import torch

    import frugality.serve.embeddings as embeddings
    from frugality.serve.embeddings import EmbeddingService
    from frugality.serve.metrics import ServeMetrics

    threads: dict[str, int] = {}  # each stream's torch threads at its warm-up call
    real = embeddings.embed_rows

    def recorded(*args, **kwargs):
        threads[threading.current_thread().name] = torch.get_num_threads()
        return real(*args, **kwargs)

    monkeypatch.setattr(embeddings, "embed_rows", recorded)
    before = torch.get_num_threads()
    torch.set_num_threads(5)
    try:
        service = EmbeddingService(encoder, ServeMetrics(), 0.0, 64, 2048, 64, streams=2)
        service.close()
    finally:
        torch.set_num_threads(before)
    assert threads == {"frugality-stream-0": 3, "frugality-stream-1": 2}
    assert service.streams_line == "; 2 streams of 2-3 threads"
