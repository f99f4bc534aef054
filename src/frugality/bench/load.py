"""The load generator of `bench serve`: plain asyncio (on uvloop where it is installed, as the
serve extra installs it: `run`), one kept-alive HTTP/1.1 connection per simulated client, every
request's bytes encoded before the clock starts.

The httpx client it replaced rescanned its whole pool on every event (encode/httpx#3215): its
own CPU per request grew with the clients (1.05 ms at 1, 6.3 ms at 64), so the table showed the
client's collapse as the server's. Here a request costs one write and one parse at any
concurrency, and each level says how busy the generator itself was; `noop` is a server that
answers at once, against which `bench serve` measures the generator's own ceiling in the same
run.

On uvloop, against asyncio's own loop, the generator and its no-op server drove 1.5-1.7x the
requests a second at one client (two rounds alternating the two, 2-core Zen 4, 2026-11-29:
benchmarks/results/serve_limit-tiny-gen-*), and by hand an answer of the no-op server at 550
requests a second was seen 0.31 ms after it was sent at the median, against 0.77 ms.
FRUGALITY_BENCH_LOOP=asyncio runs both on asyncio's own loop."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from frugality.errors import UserError

T = TypeVar("T")


def loop_name() -> str:
    """The event loop `run` uses here: what a benchmark's table says drove it."""
    return "uvloop" if _uvloop() is not None else "asyncio"


def run(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """`main()` run to its end on a new event loop: uvloop's where it is installed, else asyncio's."""
    uvloop = _uvloop()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop if uvloop is not None else None) as runner:
        return runner.run(main())


def _uvloop():
    """uvloop's module where it runs the generator: installed, and not asyncio's loop asked for
    (FRUGALITY_BENCH_LOOP=asyncio, to compare; =uvloop insists on it)."""
    asked = os.environ.get("FRUGALITY_BENCH_LOOP", "").strip().lower()
    if asked not in ("", "asyncio", "uvloop"):
        raise UserError(f"FRUGALITY_BENCH_LOOP={asked!r}: choose asyncio or uvloop (or leave it unset)")
    if asked == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if asked == "uvloop":
            raise UserError("FRUGALITY_BENCH_LOOP=uvloop: uvloop is not installed (pip install uvloop)") from None
        return None
    return uvloop


# 503; other 4xx; other statuses (5xx, 1xx, 3xx); the connection failed; no answer in time; the
# generator's own failure to connect (file descriptors, ports: the level was not driven)
ERROR_KINDS = ("overloaded", "client", "server", "transport", "timeout", "generator")


@dataclass
class Tally:
    """What one level measured, the generator's own share included."""

    latencies_ms: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)  # by ERROR_KINDS
    sent: int = 0
    lag_ms: list[float] = field(default_factory=list)  # open loop: how late each request left
    seconds: float = 0.0
    cpu_s: float = 0.0  # the generator's CPU time over the level (its one thread)

    @property
    def busy(self) -> float:
        """The generator's share of one core over the level: near 1, it was the limit."""
        return self.cpu_s / self.seconds if self.seconds else 0.0


def encode_post(host: str, port: int, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    where = f"[{host}]" if ":" in host else host
    lines = [f"POST {path} HTTP/1.1", f"Host: {where}:{port}", "Content-Type: application/json"]
    lines += [f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class Stale(Exception):
    """A kept-alive connection the server had closed (an idle time-out) before this request
    got a byte back: sent again on a new connection, as httpx and urllib3 do."""


class Connection:
    """One kept-alive connection, opened when first used and again after a failure."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        if self.writer is None:
            try:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            except OSError as e:
                if e.errno in _OWN_LIMITS:  # out of file descriptors or ports: the generator's failure
                    raise GeneratorLimit(str(e)) from None
                raise

    async def exchange(self, request: bytes) -> tuple[int, bytes]:
        """Sends `request` and reads the whole response; its status and body (chunks joined)."""
        reused = self.writer is not None
        await self.connect()
        reader, writer = self.reader, self.writer
        assert reader is not None and writer is not None
        try:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            if reused and (not isinstance(e, asyncio.IncompleteReadError) or not e.partial):
                self.close()
                raise Stale() from None
            raise
        status = int(head[9:12])
        length, chunked, close = None, False, False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                close = b"close" in value.lower()
        if status < 200 or status in (204, 304):  # (no body, whatever the headers say)
            body = b""
        elif chunked:
            chunks = []
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":  # (trailers, then the end)
                        pass
                    break
                chunks.append((await reader.readexactly(size + 2))[:-2])  # (the chunk, less its CRLF)
            body = b"".join(chunks)
        elif length is not None:
            body = await reader.readexactly(length)
        else:  # a body that ends with the connection
            body = await reader.read()
            close = True
        if close:
            self.close()
        return status, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class GeneratorLimit(Exception):
    """The generator could not open a connection for a reason of its own (file descriptors,
    local ports): counted apart, and the level marked as not driven."""


_OWN_LIMITS = {errno.EMFILE, errno.ENFILE, errno.EADDRNOTAVAIL}


async def _one(connection: Connection, request: bytes, timeout_s: float, tally: Tally, since: float) -> None:
    """One request on `connection`; its latency counts from `since` (its arrival)."""
    try:
        async with asyncio.timeout(timeout_s):
            try:
                status, _ = await connection.exchange(request)
            except Stale:
                status, _ = await connection.exchange(request)
    except TimeoutError:
        connection.close()  # (a response may still come on it)
        tally.errors["timeout"] += 1
        return
    except GeneratorLimit:
        tally.errors["generator"] += 1
        return
    except (OSError, Stale, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
        connection.close()
        tally.errors["transport"] += 1
        return
    if 200 <= status < 300:
        tally.latencies_ms.append((time.perf_counter() - since) * 1000)
    elif status == 503:
        tally.errors["overloaded"] += 1
    elif 400 <= status < 500:
        tally.errors["client"] += 1
    else:
        tally.errors["server"] += 1


async def closed_loop(
    host: str, port: int, requests: list[bytes], clients: int, duration: float, timeout_s: float = 300.0
) -> Tally:
    """`clients` clients on a connection each, each sending its next request once its last
    was answered, for `duration` seconds."""
    tally = Tally()
    connections = [Connection(host, port) for _ in range(clients)]
    cpu, start = time.process_time(), time.perf_counter()
    end = start + duration

    async def client(connection: Connection) -> None:
        while (now := time.perf_counter()) < end:
            i = tally.sent
            tally.sent += 1
            await _one(connection, requests[i % len(requests)], timeout_s, tally, now)

    try:
        await asyncio.gather(*(client(c) for c in connections))
    finally:
        tally.seconds, tally.cpu_s = time.perf_counter() - start, time.process_time() - cpu
        for c in connections:
            c.close()
    return tally


async def open_loop(
    host: str, port: int, requests: list[bytes], rate: float, duration: float, seed: int, timeout_s: float = 300.0
) -> Tally:
    """Requests arriving as a Poisson process at `rate` a second for `duration` seconds, each
    sent at its arrival whether or not the earlier ones were answered (on an idle connection,
    or a new one); latency counts from the arrival, so a server that falls behind shows it."""
    tally = Tally()
    rng = random.Random(seed)
    idle: list[Connection] = []
    opened: list[Connection] = []
    tasks: set[asyncio.Task] = set()

    async def send(i: int, arrival: float) -> None:
        connection = idle.pop() if idle else None
        if connection is None:
            connection = Connection(host, port)
            opened.append(connection)
        tally.lag_ms.append((time.perf_counter() - arrival) * 1000)
        await _one(connection, requests[i % len(requests)], timeout_s, tally, arrival)
        idle.append(connection)

    cpu, start = time.process_time(), time.perf_counter()
    try:
        at = 0.0
        while True:
            at += rng.expovariate(rate)
            if at > duration:
                break
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.ensure_future(send(tally.sent, start + at))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            tally.sent += 1
        if tasks:
            await asyncio.wait(tasks)
    finally:
        tally.seconds, tally.cpu_s = time.perf_counter() - start, time.process_time() - cpu
        for c in opened:
            c.close()
    return tally


class NoOp(asyncio.Protocol):
    """A server that answers every request at once with the same bytes (`response`): what the
    generator alone can drive."""

    def __init__(self, response: bytes) -> None:
        self.response, self.buffer = response, b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (a TCP server's)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            length = 0
            for line in self.buffer[:end].split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            assert self.transport is not None
            self.transport.write(self.response)


def noop_response(body: bytes) -> bytes:
    head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode("latin-1") + body


def serve_noop(body_size: int, ready) -> None:
    """Runs a no-op server on a free loopback port until killed; `ready(port)` once listening.
    (Its own process: the generator's ceiling is measured against a server that does not
    share its event loop.)"""

    async def main() -> None:
        response = noop_response(b"x" * body_size)
        server = await asyncio.get_running_loop().create_server(lambda: NoOp(response), "127.0.0.1", 0)
        ready(server.sockets[0].getsockname()[1])
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        run(main)
