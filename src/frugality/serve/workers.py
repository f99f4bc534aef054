"""`serve --workers N`: the HTTP API in N front-end processes, the model in one, as vLLM's
API servers feed its engine core. One process's GIL caps what its Python can answer (HTTP,
JSON, the API's checks: 0.16 ms an embeddings request on a 2-core Zen 4, whatever the device); N
processes answer on the one port, and their requests still batch together in the model's
process, its one queue.

Each front end listens on a socket of its own on that port (SO_REUSEPORT: the kernel
spreads new connections over them; on one shared socket, whichever front end woke first
took most of a burst of them; the command's process holds the port, bound and never
listening). Each front end has a pipe to the model's process. A front end sends what its
event loop queued in one pass as one message (a request's texts, each answered request's
count and latency), and the model's process answers from a thread per pipe, off the model thread,
with what its batches settled since its last message. `/metrics` is the model process's
registry, whichever front end is asked. Embeddings only: a decoder's streamed completions
are served by one process.

Nothing here imports torch: a front end is a fresh interpreter (spawned) with FastAPI,
uvicorn and numpy."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import queue
import signal
import socket
import sys
import threading
from typing import TYPE_CHECKING, cast

from frugality.serve.protocol import APIError, Limits

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from frugality.serve.app import State
    from frugality.serve.embeddings import EmbeddingService

_END = object()


# ---- in a front end ----


class Pipe:
    """A front end's end of its pipe: `ask` sends a question and returns the asyncio future
    of its answer; `post` sends what needs none. Both are called on the event loop and sent
    together when the loop next turns; a reader thread settles the answers on the loop."""

    def __init__(self, conn: Connection, state: State, loop: asyncio.AbstractEventLoop, lost) -> None:
        self.conn, self.state, self.loop, self.lost = conn, state, loop, lost
        self.pending: dict[int, asyncio.Future] = {}
        self.outgoing: list[tuple] = []
        self.ids = itertools.count()
        self.reader = threading.Thread(target=self._read, name="frugality-pipe", daemon=True)

    def post(self, op: tuple) -> None:
        if not self.outgoing:
            self.loop.call_soon(self.flush)
        self.outgoing.append(op)

    def ask(self, kind: str, *args) -> asyncio.Future:
        key = next(self.ids)
        self.pending[key] = answer = self.loop.create_future()
        self.post((kind, key, *args))
        return answer

    def flush(self) -> None:
        ops, self.outgoing = self.outgoing, []
        if ops:
            with contextlib.suppress(OSError):  # (the model's process gone: the reader says so)
                self.conn.send(ops)

    def _read(self) -> None:
        while True:
            try:
                replies = self.conn.recv()
            except (EOFError, OSError):
                replies = None
            with contextlib.suppress(RuntimeError):  # (the loop closed: the front end is ending)
                self.loop.call_soon_threadsafe(self._settle, replies)
            if replies is None:
                return

    def _settle(self, replies: list[tuple] | None) -> None:
        if replies is None:  # the model's process ended: nothing more will be answered
            self.state.service, self.state.problem = None, self.state.problem or "the model's process ended"
            for answer in self.pending.values():
                if not answer.done():
                    answer.set_exception(APIError(503, "the server is stopping; retry", None, "server_shutdown"))
            self.pending.clear()
            self.lost()
            return
        for reply in replies:
            kind = reply[0]
            if kind == "ready":
                # (what the route does with either: `submit`, and await what it returns)
                self.state.service = cast("EmbeddingService", ProxyEmbeddings(self))
                self.post(("ready",))
                continue
            if kind == "failed":
                self.state.problem = reply[1]
                continue
            answer = self.pending.pop(reply[1], None)
            if answer is None or answer.done():
                continue
            if kind == "done":
                answer.set_result(reply[2])
            elif kind == "error":
                status, message, param, code, headers = reply[2]
                error = APIError(status, message, param, code)
                error.headers = headers
                answer.set_exception(error)
            else:  # a fault in the model's process: a 500 that names it (Edge), as with one process
                name, message = reply[2]
                answer.set_exception(type(name, (Exception,), {})(message))


class ProxyEmbeddings:
    """What the embeddings route calls in a front end: the model process's service, by pipe."""

    endpoint = "embeddings"

    def __init__(self, pipe: Pipe) -> None:
        self.pipe = pipe

    def submit(self, texts: list[str]) -> asyncio.Future:
        return self.pipe.ask("embed", texts)


class ForwardedMetrics:
    """A front end's `/metrics`: each request answered is posted to the model's process,
    whose registry every scrape reads (the posts before a scrape are counted in it)."""

    def __init__(self) -> None:
        self.pipe: Pipe | None = None

    def answered(self, endpoint: str, status: str, seconds: float) -> None:
        if self.pipe is not None:
            self.pipe.post(("answered", endpoint, status, seconds))

    async def scrape(self) -> bytes:
        assert self.pipe is not None  # (set before the server starts)
        return await self.pipe.ask("metrics")


def listener(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening; `reuse_port`: one of several on it."""
    # proto named: asyncio sets TCP_NODELAY on the connections only of a socket that says it is
    # TCP, and without it a kept-alive connection's response waits ~40 ms on delayed ACKs
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def front_end(
    address: tuple[str, int],
    conn: Connection,
    name: str,
    limits: Limits,
    api_key: str | None,
    created: int,
    drain_s: float,
) -> None:
    """A front end's process: uvicorn on its own socket on the server's port until SIGTERM or
    SIGINT (the drain as with one process), or until the model's process ends."""
    stopping = []  # a signal before uvicorn's handlers are in: it stops as soon as it starts
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    import uvicorn

    from frugality.serve.app import State, build_app
    from frugality.serve.edge import QuietCancel

    sock = listener(*address, reuse_port=True)
    sock.listen(2048)
    metrics = ForwardedMetrics()
    state = State(name, limits, metrics, api_key)
    state.created = created  # (/v1/models: the same from every front end)
    state.log = lambda line: print(line, file=sys.stderr, flush=True)
    config = uvicorn.Config(
        build_app(state),
        log_level="warning",
        timeout_graceful_shutdown=drain_s or 0.001,  # pyright: ignore[reportArgumentType] (seconds, a float)
        lifespan="off",
    )
    server = uvicorn.Server(config)
    state.stopping = lambda: server.should_exit
    logging.getLogger("uvicorn.error").addFilter(QuietCancel())
    # uvicorn raises the signal that stopped it again once drained, to the handler found
    # before: this one, so that the last counts are sent and the process ends 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    server.should_exit = bool(stopping)
    factory = config.get_loop_factory()  # (uvloop where installed, as `uvicorn.run` picks it)
    loop = factory() if factory is not None else asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    metrics.pipe = pipe = Pipe(conn, state, loop, lost=lambda: setattr(server, "should_exit", True))
    pipe.reader.start()
    gc.collect()
    gc.freeze()  # (as the one-process server does: a full collection paused every request)
    try:
        loop.run_until_complete(server.serve(sockets=[sock]))
    finally:
        loop.run_until_complete(asyncio.sleep(0))  # (callbacks posted in the last turn: their flush)
        pipe.flush()  # what was answered last, counted before the pipe closes
        conn.close()
        loop.close()


# ---- in the model's process ----


class FrontEnd:
    """The model's side of one front end's pipe: a reader thread that hands its requests to
    the service and its counts to the registry, a writer thread that sends what was settled."""

    def __init__(self, conn: Connection, state: State) -> None:
        self.conn, self.state = conn, state
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.acknowledged = threading.Event()  # it saw "ready": its routes take requests
        self.threads = [
            threading.Thread(target=self._read, name="frugality-front-end-in", daemon=True),
            threading.Thread(target=self._write, name="frugality-front-end-out", daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def tell(self, *reply) -> None:
        self.out.put(reply)

    def join(self, timeout_s: float) -> None:
        """After its process has ended: what it sent last is read, and the pipe closed."""
        for thread in self.threads:
            thread.join(timeout_s)
        self.conn.close()

    def _read(self) -> None:
        while True:
            try:
                ops = self.conn.recv()
            except (EOFError, OSError):
                break
            for op in ops:
                try:
                    self._do(op)
                except Exception as e:  # a fault of ours: that request's 500, the pipe goes on
                    if op[0] in ("embed", "metrics"):
                        self.tell("fault", op[1], (type(e).__name__, str(e)))
        self.out.put(_END)

    def _do(self, op: tuple) -> None:
        kind = op[0]
        if kind == "answered":
            self.state.metrics.answered(*op[1:])
        elif kind == "embed":
            key, texts = op[1], op[2]
            service = cast("EmbeddingService | None", self.state.service)  # (front ends: embeddings only)
            try:
                if service is None:  # (a front end asks only once told "ready")
                    raise APIError(503, "the model is loading; retry shortly", None, "server_not_ready")
                future = service.submit(texts)
            except APIError as e:
                self.tell("error", key, _fields(e))
                return
            future.add_done_callback(lambda f, key=key: self.out.put(_answer(key, f)))
        elif kind == "metrics":
            self.tell("done", op[1], self.state.metrics.exposition())
        elif kind == "ready":
            self.acknowledged.set()

    def _write(self) -> None:
        while True:
            replies = [self.out.get()]
            while replies[-1] is not _END:
                try:
                    replies.append(self.out.get_nowait())
                except queue.Empty:
                    break
            end = replies[-1] is _END
            if end:
                replies.pop()
            if replies:
                try:
                    self.conn.send(replies)
                except OSError:  # its process ended: the reader ends too
                    return
                except Exception as e:  # an answer that cannot be sent (pickled): each its 500
                    self.conn.send([("fault", r[1], (type(e).__name__, str(e))) for r in replies if len(r) > 2])
            if end:
                return


def _fields(error: APIError) -> tuple:
    return error.status, error.message, error.param, error.kind, error.headers


def _answer(key: int, future) -> tuple:
    if future.cancelled():
        return "error", key, (503, "the server is stopping; retry", None, "server_shutdown", {})
    error = future.exception()
    if isinstance(error, APIError):
        return "error", key, _fields(error)
    if error is not None:
        return "fault", key, (type(error).__name__, str(error))
    return "done", key, future.result()
