"""`bench serve`'s load generator (frugality.bench.load) against real servers on the loopback:
a server that answers by path (200, 503, 404, 500, a closed connection, no answer, a chunked
body), and its own no-op server. Each outcome is counted under its kind, a failed connection
is opened again, and the generator says how busy it was."""

from __future__ import annotations

import asyncio
import json

import pytest

from frugality.bench.load import closed_loop, encode_post, loop_name, noop_response, open_loop, run
from frugality.errors import UserError

ANSWERS = {
    b"/ok": noop_response(b'{"ok": true}'),
    b"/busy": b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\nretry-after: 1\r\n\r\n{}",
    b"/missing": b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\n{}",
    b"/fault": b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 2\r\n\r\n{}",
    b"/chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n",
}


class ByPath(asyncio.Protocol):
    """Answers each request by its path; `/close` drops the connection, `/hang` never answers."""

    def connection_made(self, transport) -> None:
        self.transport, self.buffer = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, _, rest = self.buffer.partition(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ),
                0,
            )
            if len(rest) < length:
                return
            self.buffer = rest[length:]
            path = head.split(b" ")[1]
            if path == b"/close":
                self.transport.close()
                return
            if path != b"/hang":
                self.transport.write(ANSWERS[path])


def _requests(port: int, *paths: str) -> list[bytes]:
    return [encode_post("127.0.0.1", port, p, json.dumps({"input": "x"}).encode(), {}) for p in paths]


def test_each_outcome_is_counted_by_kind_and_a_lost_connection_is_opened_again():
    async def count():
        server = await asyncio.get_running_loop().create_server(ByPath, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        paths = ["/ok", "/busy", "/missing", "/fault", "/close", "/chunked", "/hang"]
        async with server:
            # (a time-out of 0.25 s: at 0.05 s, an answer the loaded machine of a second test worker
            # delayed was once counted as one)
            return await closed_loop("127.0.0.1", port, _requests(port, *paths), 1, 1.0, timeout_s=0.25)

    tally = asyncio.run(count())
    rounds = tally.sent // 7
    assert rounds >= 2  # every path, at least twice over, on a connection opened again after each loss
    assert len(tally.latencies_ms) >= 2 * rounds  # /ok and /chunked
    assert tally.errors["overloaded"] >= rounds and tally.errors["client"] >= rounds
    assert tally.errors["server"] >= rounds and tally.errors["transport"] >= rounds
    assert tally.errors["timeout"] >= rounds - 1  # (the level may end while one hangs)
    assert sum(tally.errors.values()) + len(tally.latencies_ms) == tally.sent
    assert 0 < tally.busy <= 1.5 and tally.seconds >= 1.0


def test_the_open_loop_sends_each_arrival_on_time_and_the_noop_server_answers_every_one():
    import subprocess
    import sys

    # (in a process of its own, as bench serve starts it)
    script = "import sys; from frugality.bench.load import serve_noop; serve_noop(int(sys.argv[1]), print)"
    noop = subprocess.Popen([sys.executable, "-u", "-c", script, "100"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(noop.stdout.readline())
        requests = _requests(port, "/v1/embeddings")
        tally = run(lambda: open_loop("127.0.0.1", port, requests, 200.0, 1.0, seed=0))  # (as bench serve runs it)
        assert 120 <= tally.sent <= 280  # a Poisson process at 200/s for a second
        assert len(tally.latencies_ms) == len(tally.lag_ms) == tally.sent and not tally.errors
        closed = asyncio.run(closed_loop("127.0.0.1", port, requests, 8, 0.5))
        assert len(closed.latencies_ms) == closed.sent > 8 and not closed.errors
    finally:
        noop.kill()
        noop.wait()


def test_the_generator_runs_on_uvloop_where_it_is_installed_and_says_so(monkeypatch):
    import importlib.util

    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__.split(".")[0]

    monkeypatch.delenv("FRUGALITY_BENCH_LOOP", raising=False)
    installed = importlib.util.find_spec("uvloop") is not None
    assert run(which) == loop_name() == ("uvloop" if installed else "asyncio")
    monkeypatch.setenv("FRUGALITY_BENCH_LOOP", "asyncio")  # (asked for: to compare)
    assert run(which) == loop_name() == "asyncio"
    monkeypatch.setenv("FRUGALITY_BENCH_LOOP", "tokio")
    with pytest.raises(UserError, match=r"^FRUGALITY_BENCH_LOOP='tokio': choose asyncio or uvloop"):
        loop_name()


def test_a_bad_generator_loop_is_one_line_before_any_server_starts(monkeypatch, capsys):
    from frugality.cli.main import main

    monkeypatch.setenv("FRUGALITY_BENCH_LOOP", "tokio")
    assert main(["bench", "serve", "/no/such/model", "--rate", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: FRUGALITY_BENCH_LOOP='tokio': choose asyncio or uvloop (or leave it unset)"]
