"""The HTTP API (FastAPI): `POST /v1/embeddings` (an encoder; answered as plain ASGI past
FastAPI's layers) or `POST /v1/completions` (a decoder; `stream: true` sends server-sent
events), `GET /v1/models`, `GET /health` (200 once the model is loaded and warmed, 503
before), `GET /metrics` (Prometheus). Every error is OpenAI's error object with its status;
a request never takes the process down."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import time
import uuid
from typing import TYPE_CHECKING, cast

import numpy as np
import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from frugality.serve.edge import Edge
from frugality.serve.protocol import APIError, Limits, completions_request, embeddings_request, parse_json

if TYPE_CHECKING:
    from collections.abc import AsyncIterable, AsyncIterator, Callable

    from frugality.serve.completions import CompletionService
    from frugality.serve.embeddings import EmbeddingService


class FastJSON(Response):
    """A JSON response written by orjson: numpy rows as they are, a few microseconds a
    request where `json` and `tolist()` took a tenth of a millisecond for MiniLM's 384."""

    media_type = "application/json"

    def render(self, content) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


class State:
    """What the routes share (as `request.app.state.frugality`: `served`), set by the server as
    the model loads."""

    def __init__(self, name: str, limits: Limits, metrics, api_key: str | None) -> None:
        self.name, self.limits, self.metrics, self.api_key = name, limits, metrics, api_key
        self.service: EmbeddingService | CompletionService | None = None  # once loaded and warmed
        self.created = int(time.time())
        self.problem: str | None = None  # why the model could not be loaded
        self.stopping: Callable[[], bool] = lambda: False  # whether the server is draining (set by the server)
        self.log = lambda line: None  # the server's log, a line at a time


def build_app(state: State) -> EmbeddingsFastPath:
    """The application: its routers, OpenAI's error objects for every error, the edge
    middleware (counts, 500s, the drain); `state` is what the routes share (`served`).
    `POST /v1/embeddings` is answered past FastAPI's layers (`EmbeddingsFastPath`)."""
    app = FastAPI(title="frugality", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.frugality = state

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):  # an unknown path or method
        body = APIError(error.status_code, str(error.detail)).body()
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)  # (a 405's Allow)

    app.add_middleware(Edge, state=state)  # counts, 500s and the drain's end (frugality.serve.edge)
    for router in (service_routes, embedding_routes, completion_routes):
        app.include_router(router)
    return EmbeddingsFastPath(app, state)


class EmbeddingsFastPath:
    """`POST /v1/embeddings` answered by `answer_embeddings` as plain ASGI, within `Edge` as
    every route is (its counts in `/metrics`); everything else goes to the FastAPI app, whose
    layers (middlewares, routing, request and response objects) this route skips: it is the
    one a server of embeddings answers all day (docs/serving.md: figures). Middleware or
    OpenTelemetry added to the FastAPI app does not see it."""

    def __init__(self, app: FastAPI, state: State) -> None:
        self.app, self.state = app, state
        self.edge = Edge(self._embeddings, state, endpoint="/v1/embeddings")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == "/v1/embeddings":
            await self.edge(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _embeddings(self, scope, receive, send) -> None:
        authorization, content_length = None, None  # each header's first value, as Starlette reads it
        for name, value in scope["headers"]:  # (names lowercased by the server, as ASGI has them)
            if name == b"authorization" and authorization is None:
                authorization = value.decode("latin-1")
            elif name == b"content-length" and content_length is None:
                content_length = value.decode("latin-1")
        status, extra = 200, None
        try:
            content, extra = await answer_embeddings(self.state, authorization or "", content_length, _chunks(receive))
        except APIError as error:
            content, status, extra = error.body(), error.status, error.headers
        body = orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
        out = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        out += [(k.lower().encode(), v.encode()) for k, v in (extra or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": body})


async def _chunks(receive) -> AsyncIterator[bytes]:
    """A request's body as it arrives (Starlette's `Request.stream` without the request)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


# What a route checks first, in this order: the key (401), the model (503 or 404), the body
# (413), the state reached through `served(request)`. Plain calls, not `Depends`: each would add
# a sub-dependency to FastAPI's solver on every request of the hot path.


def served(request: Request) -> State:
    return request.app.state.frugality


def authorized(state: State, authorization: str) -> None:
    """`authorization`: the request's Authorization header ("" without one)."""
    if state.api_key is None:
        return
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), state.api_key.encode()):
        raise APIError(401, "a valid API key is required: Authorization: Bearer KEY", None, "invalid_api_key")


def ready(state: State, kind: str):
    """The loaded service of `kind` ("embeddings" or "completions"), else a 503 (loading) or
    a 404 (the other kind of model)."""
    if state.service is None:
        error = APIError(503, "the model is loading; retry shortly", None, "server_not_ready")
        error.headers = {"Retry-After": "1"}
        raise error
    if state.service.endpoint != kind:
        other = "an encoder: POST /v1/embeddings" if kind == "completions" else "a decoder: POST /v1/completions"
        raise APIError(404, f"this server serves {other}", None, "not_found_error")
    return state.service


async def json_body(state: State, content_length: str | None, chunks: AsyncIterable[bytes]) -> dict:
    """The request's JSON object from its body's `chunks`, read up to the body limit (a
    larger one is a 413, as soon as its Content-Length says so)."""
    limits = state.limits
    declared = content_length
    if declared and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise APIError(
            413, f"the request body is {int(declared):,} bytes, more than the limit of {limits.max_body_bytes:,}"
        )
    data = b""
    async for chunk in chunks:
        data += chunk
        if len(data) > limits.max_body_bytes:
            break
    return parse_json(data, limits)


service_routes = APIRouter()  # the server's own: health, metrics, the model list


@service_routes.get("/health")
async def health(request: Request):
    state = served(request)
    if state.service is None:
        status = {"status": "failed", "error": state.problem} if state.problem else {"status": "loading"}
        return JSONResponse(status, status_code=503)
    return {"status": "ok", "model": state.name}


@service_routes.get("/metrics")
async def metrics(request: Request):
    return Response(await served(request).metrics.scrape(), media_type="text/plain; version=0.0.4")


@service_routes.get("/v1/models")
async def models(request: Request):
    state = served(request)
    authorized(state, request.headers.get("authorization", ""))
    return {
        "object": "list",
        "data": [{"id": state.name, "object": "model", "created": state.created, "owned_by": "frugality"}],
    }


embedding_routes = APIRouter()


@embedding_routes.post("/v1/embeddings")
async def embeddings(request: Request):  # (kept for other methods' 405, and a POST under a root_path)
    headers = request.headers
    content, extra = await answer_embeddings(
        served(request), headers.get("authorization", ""), headers.get("content-length"), request.stream()
    )
    return FastJSON(content, headers=extra)


async def answer_embeddings(
    state: State, authorization: str, content_length: str | None, chunks: AsyncIterable[bytes]
) -> tuple[dict, dict | None]:
    """An embeddings request's answer (its JSON object and extra headers) from its
    Authorization and Content-Length headers and its body's chunks; a problem is an `APIError`."""
    authorized(state, authorization)
    service = cast("EmbeddingService", ready(state, "embeddings"))  # (its endpoint is that kind)
    req = embeddings_request(await json_body(state, content_length, chunks), state.limits, state.name)
    # tokenized and embedded by the service's threads: the event loop only waits
    answer = await asyncio.wrap_future(service.submit(req.texts))
    if not np.isfinite(answer.vectors).all():  # (orjson would write NaN as null, under a 200)
        raise APIError(500, "internal error (the model gave a vector that is not finite)", None, "server_error")
    if req.encoding_format == "base64":
        vectors = answer.vectors.astype("<f4", copy=False)
        encoded = [base64.b64encode(v.tobytes()).decode() for v in vectors]
    else:
        encoded = list(answer.vectors)  # (float32 rows: orjson writes them as they are)
    data = [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)]
    usage = {"prompt_tokens": answer.tokens, "total_tokens": answer.tokens}
    cut_to = {"X-Truncated-Inputs": str(answer.cut)} if answer.cut else None  # texts cut to the model's length
    return {"object": "list", "data": data, "model": state.name, "usage": usage}, cut_to


completion_routes = APIRouter()


@completion_routes.post("/v1/completions")
async def completions(request: Request):
    state = served(request)
    authorized(state, request.headers.get("authorization", ""))
    service = cast("CompletionService", ready(state, "completions"))  # (its endpoint is that kind)
    from frugality.serve.completions import sampling_for  # (torch: never in a front end of `--workers`)

    req = completions_request(
        await json_body(state, request.headers.get("content-length"), request.stream()), state.limits, state.name
    )
    rows = await run_in_threadpool(service.tokenize, req.prompts, req.max_tokens)
    samplings = [sampling_for(req, service.decoder, i) for i in range(len(rows))]
    ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if req.stream:
        # queued before the 200 is sent: a full queue is still a 503
        events, futures = _queue_streamed(service, req, rows, samplings, ident, created, state.name)
        return StreamingResponse(
            _stream(service, events, futures, ident, created, state.name),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    futures = service.submit_all([(row, sampling, None) for row, sampling in zip(rows, samplings, strict=True)])
    answers = asyncio.ensure_future(asyncio.gather(*map(asyncio.wrap_future, futures)))
    answers.add_done_callback(_read)  # a gather cut short ends in CancelledError: read, not logged
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([answers, gone], return_when=asyncio.FIRST_COMPLETED)
        if not answers.done():  # the client left: its rows are freed, no one to answer
            service.abandon(futures)
            answers.cancel()
            return Response(status_code=499)
        done = answers.result()
    except BaseException:  # a prompt failed, or the drain ran out: the others stop too
        answers.cancel()
        service.abandon(futures)
        raise
    finally:
        gone.cancel()
    choices = [
        {"index": i, "text": (prompt if req.echo else "") + c.text, "logprobs": None, "finish_reason": c.finish}
        for i, (prompt, c) in enumerate(zip(req.prompts, done, strict=True))
    ]
    new = sum(len(c.tokens) for c in done)
    prompt_tokens = sum(map(len, rows))
    return {
        "id": ident,
        "object": "text_completion",
        "created": created,
        "model": state.name,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": new, "total_tokens": prompt_tokens + new},
    }


def _read(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed its connection (the body was read: what comes
    next from the server is `http.disconnect`)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _chunk(ident: str, created: int, name: str, index: int, text: str, finish: str | None) -> str:
    body = {
        "id": ident,
        "object": "text_completion",
        "created": created,
        "model": name,
        "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    return f"data: {json.dumps(body)}\n\n"


def _queue_streamed(service, req, rows, samplings, ident, created, name):
    """The prompts queued (all or none), each piece of their text and their ends sent to
    an asyncio queue from the model thread."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    if req.echo:
        for i, prompt in enumerate(req.prompts):
            events.put_nowait(_chunk(ident, created, name, i, prompt, None))

    def send(item) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: no one to send to
            loop.call_soon_threadsafe(events.put_nowait, item)

    asks = [
        (row, sampling, lambda piece, i=i: send(_chunk(ident, created, name, i, piece, None)))
        for i, (row, sampling) in enumerate(zip(rows, samplings, strict=True))
    ]
    futures = service.submit_all(asks)
    for i, future in enumerate(futures):
        future.add_done_callback(lambda f, i=i: send((i, f)))
    return events, futures


async def _stream(service, events, futures, ident, created, name):
    """Server-sent events as OpenAI streams them: a chunk per piece of final text, a last
    chunk per prompt with its finish reason, then `data: [DONE]`. A client that leaves
    frees its rows."""
    left = len(futures)
    try:
        while left:
            event = await events.get()
            if isinstance(event, str):
                yield event
                continue
            i, future = event
            left -= 1
            if future.cancelled():
                continue
            error = future.exception()
            if error is not None:
                problem = APIError(500, f"internal error ({error})", None, "server_error").body()
                yield f"data: {json.dumps(problem)}\n\n"
                continue
            yield _chunk(ident, created, name, i, "", future.result().finish)
        yield "data: [DONE]\n\n"
    finally:
        if left:
            service.abandon(futures)
