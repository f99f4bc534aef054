"""The HTTP app's routes without a model (in process, through httpx's ASGI transport): each
app answers from its own state though the routers are shared, the checks come in order (the
key before the model), and a wrong method is an OpenAI error object with its `Allow`."""

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


def test_embeddings_are_answered_past_fastapi_as_its_route_answers_them_and_counted_alike(near_zero_encoder):
    from frugality.serve.embeddings import EmbeddingService

    metrics = ServeMetrics()
    state = State("beta", Limits(max_body_bytes=200), metrics, "k" * 32)
    app = build_app(state)
    keyed = {"Authorization": "Bearer " + "k" * 32}
    before = _ask(app, "POST", "/v1/embeddings", json={"input": "a"}, headers=keyed)
    assert before.status_code == 503 and before.headers["retry-after"] == "1"  # no model yet
    state.service = EmbeddingService(near_zero_encoder, metrics, 0.0, 64, 2048, 64)
    asks = [
        ({"Authorization": "Bearer x"}, {"input": "a"}),  # 401
        (keyed, {"input": "a" * 300}),  # 413: over the body limit
        (keyed, {"input": []}),  # 400
        (keyed, {"model": "beta", "input": ["a text", "another"]}),
        (keyed, {"model": "beta", "input": "a text", "encoding_format": "base64"}),
    ]
    try:
        fast = [_ask(app, "POST", "/v1/embeddings", json=body, headers=headers) for headers, body in asks]
        routed = [_ask(app.app, "POST", "/v1/embeddings", json=body, headers=headers) for headers, body in asks]
    finally:
        state.service.close()
    assert [r.status_code for r in fast] == [r.status_code for r in routed] == [401, 413, 400, 200, 200]
    assert [r.json() for r in fast] == [r.json() for r in routed]  # the same objects, vectors too
    assert all(r.headers["content-type"] == "application/json" for r in fast + routed)
    for status in ("401", "413", "400", "200"):  # counted by both paths under the route's own label
        sample = {"endpoint": "/v1/embeddings", "status": status}
        assert metrics.registry.get_sample_value("frugality_requests_total", sample) == (4 if status == "200" else 2)
