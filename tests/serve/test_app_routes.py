"""The HTTP app's routes (in process, through httpx's ASGI transport): each app answers from
its own state though the routers are shared, the checks come in order (the key before the
model), a wrong method is an OpenAI error object with its `Allow`, and `POST /v1/embeddings`
past FastAPI answers and counts as its FastAPI route does."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytest.importorskip("fastapi")

from frugality.serve.app import State, build_app  # noqa: E402
from frugality.serve.metrics import ServeMetrics  # noqa: E402
from frugality.serve.protocol import Limits  # noqa: E402


def _ask(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def test_two_apps_answer_from_their_own_state_and_check_the_key_before_the_model():
    open_app = build_app(State("alpha", Limits(), ServeMetrics(), None))
    keyed_app = build_app(State("beta", Limits(), ServeMetrics(), "k" * 32))
    listed = _ask(open_app, "GET", "/v1/models")
    assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == ["alpha"]
    assert _ask(keyed_app, "GET", "/v1/models").status_code == 401
    keyed = {"Authorization": "Bearer " + "k" * 32}
    assert [m["id"] for m in _ask(keyed_app, "GET", "/v1/models", headers=keyed).json()["data"]] == ["beta"]
    # no model loaded yet: a wrong key is still a 401, the right one a 503 that says to retry
    wrong = _ask(keyed_app, "POST", "/v1/embeddings", json={"input": "a"}, headers={"Authorization": "Bearer x"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "invalid_api_key"
    loading = _ask(keyed_app, "POST", "/v1/embeddings", json={"input": "a"}, headers=keyed)
    assert loading.status_code == 503 and loading.headers["retry-after"] == "1"
    assert _ask(open_app, "GET", "/health").json() == {"status": "loading"}


def test_a_wrong_method_is_an_error_object_naming_the_allowed_one():
    app = build_app(State("alpha", Limits(), ServeMetrics(), None))
    wrong = _ask(app, "GET", "/v1/embeddings")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["message"] == "Method Not Allowed"
    missing = _ask(app, "GET", "/v2/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"


def _chunked(body: bytes):
    async def chunks():  # (no Content-Length: the body's size is known as it arrives)
        for i in range(0, len(body), 1_000):
            yield body[i : i + 1_000]

    return chunks()


def test_embeddings_are_answered_past_fastapi_as_its_route_answers_them_and_counted_alike(near_zero_encoder):
    from frugality.serve.embeddings import EmbeddingService

    metrics = ServeMetrics()
    state = State("beta", Limits(max_body_bytes=8_000), metrics, "k" * 32)
    app = build_app(state)
    key = "Bearer " + "k" * 32
    keyed = {"Authorization": key}
    text = {"model": "beta", "input": "short"}

    def both(**kwargs) -> list[httpx.Response]:  # past FastAPI, then through its route
        if "chunks" in kwargs:
            body = kwargs.pop("chunks")
            return [_ask(a, "POST", "/v1/embeddings", content=_chunked(body), **kwargs) for a in (app, app.app)]
        return [_ask(a, "POST", "/v1/embeddings", **kwargs) for a in (app, app.app)]

    cases = [both(json=text, headers=keyed)]  # 503: no model yet
    state.service = EmbeddingService(near_zero_encoder, metrics, 0.0, 64, 2048, 64)
    try:
        cases += [
            both(json=text, headers={"Authorization": "Bearer x"}),  # 401
            both(json=text, headers=[("Authorization", "Bearer x"), ("Authorization", key)]),  # the first counts: 401
            both(json=text, headers=[("Authorization", key), ("Authorization", "Bearer x")]),  # 200
            both(json={"model": "beta", "input": "a" * 9_000}, headers=keyed),  # 413 by Content-Length
            both(chunks=b'{"input": "' + b"a" * 9_000 + b'"}', headers=keyed),  # 413 as it arrives
            both(json={"model": "beta", "input": []}, headers=keyed),  # 400
            both(json={"model": "beta", "input": ["a text", "word " * 1_000]}, headers=keyed),  # one cut
            both(json={"model": "beta", "input": "a text", "encoding_format": "base64"}, headers=keyed),
        ]
    finally:
        state.service.close()
    statuses = [[r.status_code for r in case] for case in cases]
    assert statuses == [[s, s] for s in (503, 401, 401, 200, 413, 413, 400, 200, 200)]
    for fast, routed in cases:
        assert fast.json() == routed.json()  # the same objects, vectors too
        assert sorted(fast.headers.items()) == sorted(routed.headers.items())  # (and the same headers)
    assert cases[0][0].headers["retry-after"] == "1" and cases[7][0].headers["x-truncated-inputs"] == "1"
    for status, count in (("503", 2), ("401", 4), ("200", 6), ("413", 4), ("400", 2)):  # both paths, one label
        sample = {"endpoint": "/v1/embeddings", "status": status}
        assert metrics.registry.get_sample_value("frugality_requests_total", sample) == count


def test_a_client_that_leaves_while_its_body_is_read_is_counted_499_and_not_answered():
    metrics = ServeMetrics()
    state = State("beta", Limits(), metrics, None)
    state.service = type("Loaded", (), {"endpoint": "embeddings"})()  # (its body never read whole: not called)
    app = build_app(state)

    async def ask(target, path: str) -> list[dict]:  # (the ASGI messages a server would pass)
        arriving = [
            {"type": "http.request", "body": b'{"model": "beta", "in', "more_body": True},
            {"type": "http.disconnect"},
        ]

        async def receive():
            return arriving.pop(0)

        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1), "server": ("t", 80),
        }  # fmt: skip
        await target(scope, receive, send)
        return sent

    for target in (app, app.app):  # past FastAPI, and through its route
        assert asyncio.run(ask(target, "/v1/embeddings")) == []  # nothing sent to a client that is gone
    assert (
        metrics.registry.get_sample_value("frugality_requests_total", {"endpoint": "/v1/embeddings", "status": "499"})
        == 2
    )
