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
