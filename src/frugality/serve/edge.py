"""What every request passes on its way in and out, as plain ASGI (no per-request task or
body copy, unlike Starlette's `@app.middleware("http")`): its count and latency by route
and status for `/metrics` (499 for a client that left while its body was read); a fault
of ours answered as OpenAI's error object (500); and a
request still running when the drain window (`--drain-s`) runs out, which uvicorn then
cancels, answered as a 503 error object with one log line, not a bare 500 and a traceback."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from starlette.requests import ClientDisconnect

from frugality.serve.protocol import APIError


class Edge:
    def __init__(self, app, state, endpoint: str | None = None) -> None:
        self.app, self.state = app, state
        self.endpoint = endpoint  # the metrics' label (else the route's path, which routing sets)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        sent = {"status": None, "done": False}

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                sent["status"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            if not self.state.stopping():
                raise
            what = f"{scope['method']} {scope['path']}"
            error = APIError(503, "the server stopped before this request finished; retry", None, "server_shutdown")
            if sent["status"] is None:
                await _send_error(send, error)
                sent["status"] = 503
                self.state.log(f"frugality serve: {what} still running when the drain window ended: answered 503")
            elif not sent["done"]:  # a stream: its last event says why it ends early
                body = f"data: {json.dumps(error.body())}\n\n".encode()
                await send({"type": "http.response.body", "body": body, "more_body": False})
                self.state.log(f"frugality serve: {what} (streamed) cut off when the drain window ended")
        except ClientDisconnect:  # the client left before its body was read: no one to answer
            sent["status"] = 499  # (nginx's "client closed request": counted, not as a fault of ours)
        except Exception as e:  # a fault of ours: a 500 with its name, the server goes on
            if sent["status"] is not None:
                raise
            await _send_error(send, APIError(500, f"internal error ({type(e).__name__}: {e})", None, "server_error"))
            sent["status"] = 500
        path = scope["path"]
        if path.startswith("/v1/") and sent["status"] is not None:
            route = scope.get("route")  # the route's path, not the client's: a bounded set of labels
            endpoint = self.endpoint or getattr(route, "path", "other")
            self.state.metrics.answered(endpoint, str(sent["status"]), time.perf_counter() - started)


async def _send_error(send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class QuietCancel(logging.Filter):
    """uvicorn's own line for the tasks it cancels at the end of the drain: each of them is
    logged by `Edge` instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Cancel %s running task(s)")
