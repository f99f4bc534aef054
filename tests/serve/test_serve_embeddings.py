"""`frugality serve` with an encoder, on loopback, called by real clients: the `openai`
client's vectors are `frugality embed`'s; 200 concurrent requests are all answered, each
with its own text's vector; every bad request is its 4xx with OpenAI's error object and
the server goes on; a full queue is a 503 with Retry-After, and the server recovers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import forked_cli
import httpx
import numpy as np
import pytest
import torch
from conftest import KEY, MINILM, Server

from frugality.cli.main import main
from frugality.inference.embed import read_embeddings

openai = pytest.importorskip("openai")

TEXTS = [f"sentence number {i} about a {'long ' * (i % 9)}topic" for i in range(200)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, np.ndarray]:
    """`frugality embed`'s vectors of TEXTS, by text."""
    folder = tmp_path_factory.mktemp("embed")
    (folder / "texts.txt").write_text("".join(t + "\n" for t in TEXTS))
    out = folder / "out"
    assert (
        main(["embed", MINILM, str(folder / "texts.txt"), "--out", str(out), "--precision", "fp32", "--no-progress"])
        == 0
    )
    _, vectors = read_embeddings(out)
    return dict(zip(TEXTS, vectors, strict=True))


def _cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_the_openai_client_gets_frugality_embeds_vectors(encoder_server, reference):
    client = openai.OpenAI(base_url=f"{encoder_server.url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["minilm"]
    texts = TEXTS[:5]
    got = client.embeddings.create(model="minilm", input=texts)  # the client asks for base64
    assert [d.index for d in got.data] == list(range(5))
    assert min(_cosine(d.embedding, reference[t]) for d, t in zip(got.data, texts, strict=True)) >= 0.9999
    assert got.usage.prompt_tokens > 5
    plain = httpx.post(
        f"{encoder_server.url}/v1/embeddings",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "minilm", "input": TEXTS[7]},
    ).json()  # one text, as floats
    assert _cosine(plain["data"][0]["embedding"], reference[TEXTS[7]]) >= 0.9999


def test_a_server_in_two_streams_says_so_and_answers_embeds_vectors(reference):
    server = Server(MINILM, "--name", "minilm", "--precision", "fp32", "--device", "cpu", "--streams", "2")
    try:
        assert "; 2 streams of " in server.lines[-1] and server.lines[-1].startswith("frugality serve: ready")
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        with ThreadPoolExecutor(8) as pool:  # (requests at once: both streams take some)
            got = list(pool.map(lambda t: client.embeddings.create(model="minilm", input=[t]), TEXTS[:16]))
        assert min(_cosine(g.data[0].embedding, reference[t]) for g, t in zip(got, TEXTS, strict=False)) >= 0.9999
    finally:
        assert server.stop() == 0


def test_200_concurrent_requests_are_each_answered_with_their_own_vector(encoder_server, reference):
    """200 requests written at once, on a connection each (the load generator's client: httpx
    at this concurrency sent them slower than the server answered them one by one): those
    that arrive while a batch runs are embedded together in the next."""
    from urllib.parse import urlsplit

    from frugality.bench.load import Connection, encode_post

    url = urlsplit(encoder_server.url)

    def calls() -> float:
        metrics = httpx.get(f"{encoder_server.url}/metrics").text
        prefix = 'frugality_batch_rows_count{endpoint="embeddings"}'
        return float(next(line for line in metrics.splitlines() if line.startswith(prefix)).split()[-1])

    async def run():
        connections = [Connection(url.hostname, url.port) for _ in TEXTS]
        await asyncio.gather(*(c.connect() for c in connections))
        auth = {"Authorization": f"Bearer {KEY}"}
        requests = [
            encode_post(
                url.hostname, url.port, "/v1/embeddings", json.dumps({"model": "minilm", "input": t}).encode(), auth
            )
            for t in TEXTS
        ]
        try:
            return await asyncio.gather(*(c.exchange(r) for c, r in zip(connections, requests, strict=True)))
        finally:
            for c in connections:
                c.close()

    before = calls()
    responses = asyncio.run(run())
    assert [status for status, _ in responses] == [200] * len(TEXTS)
    vectors = [json.loads(body)["data"][0]["embedding"] for _, body in responses]
    cosines = [_cosine(v, reference[t]) for v, t in zip(vectors, TEXTS, strict=True)]
    assert min(cosines) >= 0.9999  # each request its own text's vector: none lost, swapped or duplicated
    assert calls() - before < len(TEXTS) / 2  # requests were batched together


@pytest.mark.slow
def test_a_text_longer_than_the_length_is_cut_as_embed_cuts_it_and_reported_by_both(encoder_server, tmp_path):
    """One policy for texts longer than the model's length (or --max-length; the server's is
    64): cut to it, as sentence-transformers cuts them, and reported: `embed` in its closing
    line and manifest, the server in a response header and /metrics."""
    long = "word " * 100
    (tmp_path / "texts.txt").write_text(f"short\n{long}\n")
    done = forked_cli.run(
        "embed", MINILM, tmp_path / "texts.txt", "--out", tmp_path / "out", "--precision", "fp32",
        "--max-length", "64", "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "2 texts (1 cut to 64 tokens, the model's length or --max-length)" in done.stdout
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["truncated"] == 1
    response = httpx.post(
        f"{encoder_server.url}/v1/embeddings",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "minilm", "input": ["short", long]},
    )
    assert response.status_code == 200 and response.headers["x-truncated-inputs"] == "1"
    assert response.json()["usage"]["prompt_tokens"] == 3 + 64  # [CLS] short [SEP], and the cut text
    _, vectors = read_embeddings(tmp_path / "out")
    assert _cosine(response.json()["data"][1]["embedding"], vectors[1]) >= 0.9999
    metrics = httpx.get(f"{encoder_server.url}/metrics").text
    assert 'frugality_truncated_inputs_total{endpoint="embeddings"} ' in metrics


BAD = [
    # (what, headers, body, status, param)
    ("malformed JSON", None, b'{"model": "minilm", "input": ', 400, None),
    ("not an object", None, b'["minilm"]', 400, None),
    ("nested too deeply", None, b"[" * 50_000, 400, None),
    ("a lone surrogate", None, {"model": "minilm", "input": ["fine", "half \ud800"]}, 400, "input"),
    ("input of a wrong type", None, {"model": "minilm", "input": 7}, 400, "input"),
    ("input missing", None, {"model": "minilm"}, 400, "input"),
    ("empty input", None, {"model": "minilm", "input": []}, 400, "input"),
    ("an empty text", None, {"model": "minilm", "input": ["a", ""]}, 400, "input"),
    ("too many texts", None, {"model": "minilm", "input": ["a"] * 9}, 400, "input"),
    ("a body too large", None, {"model": "minilm", "input": "x" * 70_000}, 413, None),
    ("an unknown model", None, {"model": "gpt-4", "input": "a"}, 404, "model"),
    (
        "a bad encoding format",
        None,
        {"model": "minilm", "input": "a", "encoding_format": "int8"},
        400,
        "encoding_format",
    ),
    ("no key", {}, {"model": "minilm", "input": "a"}, 401, None),
    ("a wrong key", {"Authorization": "Bearer nope"}, {"model": "minilm", "input": "a"}, 401, None),
    ("the other endpoint", None, {"model": "minilm", "prompt": "a"}, 404, None),
]


@pytest.mark.parametrize("what, headers, body, status, param", BAD, ids=[b[0] for b in BAD])
def test_each_bad_request_is_its_4xx_and_the_server_goes_on(encoder_server, what, headers, body, status, param):
    headers = {"Authorization": f"Bearer {KEY}"} if headers is None else headers
    path = "/v1/completions" if what == "the other endpoint" else "/v1/embeddings"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        f"{encoder_server.url}{path}", content=content, headers=headers | {"Content-Type": "application/json"}
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param
    ok = httpx.post(
        f"{encoder_server.url}/v1/embeddings",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "minilm", "input": "still here"},
    )
    assert ok.status_code == 200


@pytest.mark.slow
def test_a_full_queue_is_a_503_with_retry_after_and_the_server_recovers():
    server = Server(MINILM, "--name", "minilm", "--precision", "fp32", "--max-queue", "1", "--batch-tokens", "8")
    try:
        long_text = " ".join(f"word{i}" for i in range(60))  # about 180 tokens

        async def burst():
            async with httpx.AsyncClient(
                base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=64)
            ) as client:
                return await asyncio.gather(
                    *(client.post("/v1/embeddings", json={"model": "minilm", "input": long_text}) for _ in range(64))
                )

        responses = asyncio.run(burst())
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 503} and 503 in codes and 200 in codes
        refused = next(r for r in responses if r.status_code == 503)
        assert refused.headers["Retry-After"] == "1" and refused.json()["error"]["type"] == "server_overloaded"
        after = httpx.post(f"{server.url}/v1/embeddings", json={"model": "minilm", "input": "calm again"})
        assert after.status_code == 200
        assert (
            'frugality_requests_total{endpoint="/v1/embeddings",status="503"}'
            in httpx.get(f"{server.url}/metrics").text
        )
    finally:
        assert server.stop() == 0


def test_what_stops_the_server_before_it_starts_is_one_line(tmp_path, capsys, monkeypatch):
    import socket

    monkeypatch.delenv("NO_SUCH_KEY_VARIABLE", raising=False)
    runs = ["--runs", str(tmp_path / "runs")]
    assert main(["serve", MINILM, "--api-key-env", "NO_SUCH_KEY_VARIABLE", *runs]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --api-key-env NO_SUCH_KEY_VARIABLE: that environment variable is empty or unset"
    ]
    assert main(["serve", str(tmp_path / "none"), *runs]) == 2
    assert capsys.readouterr().err.strip() == f"error: model {tmp_path / 'none'}: no such folder"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", MINILM, "--port", str(port), *runs]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --host 127.0.0.1 --port {port}: cannot listen there")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_the_listening_socket_says_it_is_tcp_so_connections_get_nodelay():
    """asyncio sets TCP_NODELAY only on connections of a socket whose proto is TCP; without
    it a kept-alive connection's response waited ~40 ms on delayed ACKs (bench serve)."""
    import socket

    from frugality.serve.server import _bind

    sock = _bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


@pytest.mark.slow
def test_an_int8_server_answers_within_int8s_measured_cosine_or_is_refused_in_one_line(reference):
    from frugality.errors import UserError
    from frugality.inference.encoder import int8_engine

    try:
        engine = int8_engine(torch.device("cpu"))[0]
    except UserError:  # refused before it listens: one line, exit 2
        done = subprocess.run(
            [sys.executable, "-m", "frugality", "serve", MINILM, "--precision", "int8", "--port", "0"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("error: --precision int8: ")
        return
    server = Server(MINILM, "--name", "minilm", "--precision", "int8")
    try:
        assert "int8 (asked for)" in server.text()
        got = httpx.post(f"{server.url}/v1/embeddings", json={"model": "minilm", "input": TEXTS[:40]}).json()
        cosines = [_cosine(d["embedding"], reference[t]) for d, t in zip(got["data"], TEXTS[:40], strict=True)]
        # measured: min 0.991 (PyTorch's, on VNNI), 0.974 (ONNX Runtime's, on CPUs without it)
        least = 0.98 if engine == "torch" else 0.97
        assert len(cosines) == 40 and min(cosines) >= least and np.mean(cosines) >= 0.99
    finally:
        assert server.stop() == 0
