"""`frugality bench serve`: a load generator for a running `frugality serve` (or any
OpenAI-compatible endpoint), or for a model it serves itself for the run.

- Open loop (`rates`): requests arrive as a Poisson process at each rate for `duration`
  seconds, sent whether or not earlier ones were answered, as users' requests arrive;
  latency counts from each request's scheduled arrival, so a server that falls behind
  shows it.
- Closed loop (`concurrency`): that many clients, each sending its next request when its
  last was answered.

Each level reports throughput (answered requests a second), p50/p95/p99 latency, errors,
and the energy per 1,000 requests from the server's `/metrics` (`frugality_energy_joules`:
its meter, labelled measured or estimated). The saturation rate is the highest open-loop
rate whose p99 stays under the SLO with no errors."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from frugality.bench.load import ERROR_KINDS, Tally, closed_loop, encode_post, loop_name, open_loop, run
from frugality.errors import UserError

LAG_MS = 10.0  # an open-loop request sent later than this after its arrival (p99): the generator fell behind


@dataclass
class Level:
    mode: str  # "rate" or "concurrency"
    level: float
    tally: Tally
    joules: float | None
    energy_kind: str | None
    rows_per_call: float | None = None  # the server's, from its /metrics over the level
    queue_ms: float | None = None
    ceiling: float | None = None  # what the generator drove against the no-op server at this level
    server: str = "frugality"
    device: str | None = None  # where the server ran: "cuda:0 (NVIDIA H200)"; None for a server at a URL
    precision: str | None = None  # what it said it runs in
    front_ends: int | None = None  # its HTTP processes, where `serve --workers` ran more than one

    @property
    def driven(self) -> bool:
        """Whether the generator kept up, so that the level measured the server: its one thread
        busy under 90% of the level, no connection it failed to open for a reason of its own,
        open-loop requests sent within 10 ms of their arrival (p99) and at a rate under 90% of
        its ceiling, closed-loop throughput under 90% of its ceiling at that many clients."""
        t = self.tally
        if t.busy >= 0.9 or t.errors["generator"]:
            return False
        if self.mode == "rate":
            lag = _quantile(sorted(t.lag_ms), 0.99)
            return (lag is None or lag <= LAG_MS) and (self.ceiling is None or self.level <= 0.9 * self.ceiling)
        ok = len(t.latencies_ms) / t.seconds if t.seconds else 0.0
        return self.ceiling is None or ok < 0.9 * self.ceiling

    def row(self) -> dict:
        t = self.tally
        q = lambda values, p: _quantile(sorted(values), p)  # noqa: E731
        ok, seconds = len(t.latencies_ms), t.seconds
        return {
            "server": self.server,
            "device": self.device,
            "precision": self.precision,
            "front_ends": self.front_ends,
            "mode": self.mode,
            "level": self.level,
            "requests": t.sent,
            "ok": ok,
            "errors": sum(t.errors.values()),
            "errors_by_kind": {k: t.errors[k] for k in ERROR_KINDS if t.errors[k]},
            "throughput_per_s": round(ok / seconds, 2) if seconds else None,
            "p50_ms": q(t.latencies_ms, 0.50),
            "p95_ms": q(t.latencies_ms, 0.95),
            "p99_ms": q(t.latencies_ms, 0.99),
            "seconds": round(seconds, 3),
            "rows_per_call": None if self.rows_per_call is None else round(self.rows_per_call, 2),
            "queue_ms": None if self.queue_ms is None else round(self.queue_ms, 2),
            "generator_busy": round(t.busy, 3),
            "send_lag_p99_ms": q(t.lag_ms, 0.99),
            "generator_ceiling_per_s": None if self.ceiling is None else round(self.ceiling, 1),
            "driven": self.driven,
            "joules_per_1000": round(self.joules / ok * 1000, 2) if self.joules is not None and ok else None,
            "watts": round(self.joules / seconds, 2) if self.joules is not None and seconds else None,
            "energy": self.energy_kind,
        }


def _quantile(ordered: list[float], p: float) -> float | None:
    """The nearest-rank quantile."""
    return round(ordered[max(0, math.ceil(p * len(ordered)) - 1)], 1) if ordered else None


class Target:
    """The endpoint under load: a URL, or a server started here for a model folder."""

    def __init__(self, target: str, api_key: str | None, serve_args: list[str], log, name: str = "frugality") -> None:
        self.process: subprocess.Popen | None = None
        self.name, self.precision = name, None  # the precision a started server says it chose
        self.device: str | None = None  # and its device, "cuda:0 (NVIDIA H200)" (unknown at a URL)
        self.front_ends: int | None = None  # and its HTTP processes (`serve --workers`), when more than one
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if re.match(r"https?://", target):
            url = target.rstrip("/").removesuffix("/v1")
        elif not os.path.exists(target):
            raise UserError(f"{target}: neither a URL (http://...) nor a model folder")
        try:  # a server started here is stopped however the checks end (Ctrl-C included)
            if not re.match(r"https?://", target):
                url = self._start(target, serve_args, log)
            self._connect(target, url)
        except BaseException:
            self.stop()
            raise

    def _connect(self, target: str, url: str) -> None:
        self.url = url
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise UserError(f"{target}: bench serve loads http:// endpoints (a TLS proxy in front is not measured)")
        try:  # the name resolved once, not at every connection the generator opens
            host = str(socket.getaddrinfo(parts.hostname, parts.port or 80, type=socket.SOCK_STREAM)[0][4][0])
        except OSError as e:
            raise UserError(f"{target}: {parts.hostname} does not resolve ({e})") from None
        self.host, self.port, self.prefix = host, parts.port or 80, parts.path
        self.hostname = parts.hostname  # (the Host header)
        status, text = self.get(f"{self.prefix}/v1/models", auth=True)
        if status != 200:
            raise UserError(f"{self.url}/v1/models: " + (f"HTTP {status} ({text[:200]})" if status else text))
        try:
            self.model = json.loads(text)["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise UserError(f"{self.url}/v1/models: not OpenAI's list of models ({text[:200]})") from None
        self.endpoint = self._endpoint()

    def get(self, path: str, auth: bool = False, body: dict | None = None) -> tuple[int, str]:
        """A plain request (the probes and /metrics): its status (0: no answer) and text."""
        data = None if body is None else json.dumps(body).encode()
        headers = (self.headers if auth else {}) | ({"Content-Type": "application/json"} if data else {})
        host = f"[{self.hostname}]" if ":" in self.hostname else self.hostname
        request = urllib.request.Request(f"http://{host}:{self.port}{path}", data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode("utf-8", "replace")
        except (OSError, ValueError) as e:
            return 0, f"no server answers ({e})"

    def _start(self, model: str, serve_args: list[str], log) -> str:
        import tempfile

        command = [sys.executable, "-m", "frugality", "serve", model, "--port", "0", *serve_args]
        log(f"starting: {' '.join(command[2:])}")
        # (a pipe could fill); kept for the server's life
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-serve-", suffix=".log")  # noqa: SIM115
        self.process = subprocess.Popen(command, stderr=self.log, text=True, start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            with open(self.log.name) as f:
                text = f.read()
            ready = re.search(r"ready, POST (http://\S+?)/v1/\S+ \((\w+)", text)
            if ready:
                self.precision = ready.group(2)
                device = re.search(r"; device: (.+)$", text[ready.start() :].splitlines()[0])
                self.device = device.group(1).strip() if device else None
                front_ends = re.search(r"HTTP in (\d+) front-end processes", text)
                self.front_ends = int(front_ends.group(1)) if front_ends else None
                return ready.group(1)
            if self.process.poll() is not None:
                error = [line for line in text.splitlines() if line.startswith("error:")]
                raise UserError(f"frugality serve {model}: {error[-1].removeprefix('error: ') if error else 'ended'}")
            time.sleep(0.1)
        self.stop()
        raise UserError(f"frugality serve {model}: not ready after 600 s")

    def _endpoint(self) -> str:
        """embeddings or completions, asked of the server once it is ready."""
        deadline = time.monotonic() + 600
        while self.get(f"{self.prefix}/health")[0] != 200:
            if time.monotonic() > deadline:
                raise UserError(f"{self.url}/health: not ready after 600 s")
            time.sleep(0.5)
        status, text = self.get(f"{self.prefix}/v1/embeddings", auth=True, body={"model": self.model, "input": "probe"})
        if status == 200:
            return "embeddings"
        if status == 404:
            return "completions"
        raise UserError(f"{self.url}/v1/embeddings: HTTP {status} ({text[:200]})")

    def body(self, text: str, max_tokens: int) -> dict:
        if self.endpoint == "embeddings":
            return {"model": self.model, "input": text}
        return {"model": self.model, "prompt": text, "max_tokens": max_tokens, "temperature": 0}

    def requests(self, texts: list[str], max_tokens: int) -> list[bytes]:
        """Each text's request, encoded once before any clock starts."""
        path = f"{self.prefix}/v1/{self.endpoint}"
        return [
            encode_post(self.hostname, self.port, path, json.dumps(self.body(t, max_tokens)).encode(), self.headers)
            for t in texts
        ]

    def server_metrics(self) -> tuple[dict[str, float], str | None]:
        """The counters a level reads before and after (absent on a server without them):
        energy, and the sums and counts of rows per model call and time queued; and the
        energy's kind (measured, declared or estimated)."""
        status, text = self.get(f"{self.prefix}/metrics")
        found: dict[str, float] = {}
        energy = None
        if status != 200:
            return found, energy
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in _COUNTERS:
                if name == "frugality_energy_joules_total":
                    kind = re.search(r'kind="([^"]*)"', line)
                    energy = kind.group(1) if kind else None
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return found, energy

    def stop(self) -> None:
        """SIGTERM (the server drains), SIGKILL to its process group after 120 s."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGCONT)  # (held while another was measured)
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


_COUNTERS = (
    "frugality_energy_joules_total",
    "frugality_batch_rows_sum",
    "frugality_batch_rows_count",
    "frugality_queue_seconds_sum",
    "frugality_queue_seconds_count",
)


def near_zero_encoder(like: str | Path, out: str | Path, seed: int = 0) -> Path:
    """The encoder folder `like` with a BERT of one layer and width 32 (random weights, seeded)
    in place of its model: the same tokenizer, vocabulary and pooling, a model that costs
    almost nothing, so that a serving benchmark measures the server."""
    import torch

    from frugality.interop.hf import export_hf, import_hf
    from frugality.models import build_model

    like = Path(like)
    config, _ = import_hf(like)
    small = config.model_copy(update={"hidden_size": 32, "num_layers": 1, "num_heads": 4, "intermediate_size": 64})
    torch.manual_seed(seed)
    state = build_model(small).state_dict()
    files = {
        p.relative_to(like).as_posix(): p.read_bytes()
        for p in sorted(like.rglob("*"))
        if p.is_file() and p.suffix not in (".safetensors", ".bin") and p.relative_to(like).as_posix() != "config.json"
    }
    if "1_Pooling/config.json" in files:  # (sentence-transformers reads the width there)
        pooling = json.loads(files["1_Pooling/config.json"]) | {"word_embedding_dimension": 32}
        files["1_Pooling/config.json"] = json.dumps(pooling, indent=2).encode()
    return export_hf(small, state, out, files)


def generator_ceiling(
    target: Target, texts: list[str], clients: list[int], duration: float, log, hold: tuple[Target, ...] = ()
) -> dict[int, float]:
    """What the generator alone drives at each number of clients: the same requests sent to a
    server in a process of its own that answers each at once with a body as long as the
    target's answer (`frugality.bench.load.serve_noop`); the servers in `hold` are stopped
    meanwhile."""
    status, text = target.get(f"{target.prefix}/v1/{target.endpoint}", auth=True, body=target.body(texts[0], 1))
    size = len(text.encode()) if status == 200 else 512
    _hold_others(list(hold), None, every=True)
    script = "import sys; from frugality.bench.load import serve_noop; serve_noop(int(sys.argv[1]), print)"
    noop = subprocess.Popen(
        [sys.executable, "-u", "-c", script, str(size)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert noop.stdout is not None
        port = int(noop.stdout.readline())
        path = f"/v1/{target.endpoint}"
        requests = [encode_post("127.0.0.1", port, path, json.dumps(target.body(t, 1)).encode(), {}) for t in texts]
        ceiling = {}
        for n in sorted(set(clients)):
            tally = run(lambda n=n: closed_loop("127.0.0.1", port, requests, n, duration))
            ceiling[n] = len(tally.latencies_ms) / tally.seconds
            log(f"the generator's ceiling: {ceiling[n]:,.0f} req/s at {n} clients (against a no-op server)")
        return ceiling
    finally:
        noop.kill()
        noop.wait()
        _hold_others(list(hold), None)


def run_levels(
    targets: list[Target],
    texts: list[str],
    rates: list[float],
    concurrencies: list[int],
    duration: float,
    max_tokens: int,
    seed: int,
    log,
    ceiling: dict[int, float] | None = None,
) -> list[Level]:
    """Each open-loop rate, then each number of clients, each target in turn at each level (a
    race: the machine's drift is shared); `ceiling`: the generator's at each number of
    clients (its largest for the open loop)."""
    requests = {id(t): t.requests(texts, max_tokens) for t in targets}
    ceiling = ceiling or {}
    top = max(ceiling.values()) if ceiling else None
    levels = []
    for mode, values in (("rate", rates), ("concurrency", concurrencies)):
        for value in values:
            for t in targets:
                _hold_others(targets, t)
                if mode == "rate":
                    drive = lambda t=t, v=value: open_loop(t.host, t.port, requests[id(t)], v, duration, seed)
                    levels.append(_measure(t, mode, value, drive, top))
                else:
                    drive = lambda t=t, v=value: closed_loop(t.host, t.port, requests[id(t)], int(v), duration)
                    levels.append(_measure(t, mode, value, drive, ceiling.get(int(value))))
                log(_line(levels[-1]))
    _hold_others(targets, None)
    return levels


def _hold_others(targets: list[Target], running: Target | None, every: bool = False) -> None:
    """The servers started here other than `running` stopped (SIGSTOP to their process group)
    while it is measured, and `running` let go (SIGCONT): an idle server that polls its
    queues (infinity-emb's batch handler sleeps and wakes every few ms) takes no CPU from the
    one under load. `running` None: every one let go, or with `every`, every one held."""
    for t in targets:
        if t.process is not None and t.process.poll() is None:
            go = t is running or (running is None and not every)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(t.process.pid, signal.SIGCONT if go else signal.SIGSTOP)


def saturation(levels: list[Level], slo_ms: float) -> dict | None:
    """The highest open-loop rate the generator drove whose p99 met the SLO with no errors,
    and its figures."""
    met = [
        lv.row() for lv in levels if lv.mode == "rate" and lv.driven and not lv.tally.errors and lv.tally.latencies_ms
    ]
    met = [r for r in met if r["p99_ms"] <= slo_ms]
    return max(met, key=lambda r: r["level"]) if met else None


def _line(level: Level) -> str:
    r = level.row()
    errors = ", ".join(f"{n} {kind}" for kind, n in r["errors_by_kind"].items())
    return (
        f"{level.server}: {r['mode']} {r['level']:g}: {r['ok']}/{r['requests']} ok{f' ({errors})' if errors else ''}, "
        f"{r['throughput_per_s']} req/s, p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms"
        + ("" if level.driven else " (the generator's limit, not the server's)")
    )


def _measure(target: Target, mode: str, level: float, measure, ceiling: float | None) -> Level:
    before, _ = target.server_metrics()
    tally = run(measure)
    after, energy = target.server_metrics()

    def delta(name: str) -> float | None:
        return after[name] - before[name] if name in after and name in before else None

    joules = delta("frugality_energy_joules_total")
    rows, calls = delta("frugality_batch_rows_sum"), delta("frugality_batch_rows_count")
    queued, taken = delta("frugality_queue_seconds_sum"), delta("frugality_queue_seconds_count")
    return Level(
        mode,
        level,
        tally,
        joules,
        energy,
        rows_per_call=rows / calls if rows is not None and calls else None,
        queue_ms=queued / taken * 1000 if queued is not None and taken else None,
        ceiling=ceiling,
        server=target.name,
        device=target.device,
        precision=target.precision,
        front_ends=target.front_ends,
    )


def markdown_table(levels: list[Level], missing: dict[str, str] | None = None) -> str:
    """A row a level (and a server, when peers race: a column names it); a peer that could
    not run is a row saying why."""
    servers = len({lv.server for lv in levels}) > 1 or bool(missing)
    first = "| server " * servers
    lines = [
        f"{first}| device, precision | mode | level | requests | ok | errors | req/s | p50 ms | p95 ms | p99 ms "
        "| rows/call | queued ms "
        "| generator busy | generator ceiling req/s | J/1,000 requests |",
        "|---" * (15 + servers) + "|",
    ]
    dash = lambda v: "—" if v is None else f"{v:g}"  # noqa: E731
    for lv in levels:
        r = lv.row()
        energy = "—" if r["joules_per_1000"] is None else f"{r['joules_per_1000']:,.1f} ({r['energy']})"
        unit = "req/s" if r["mode"] == "rate" else "clients"
        errors = str(r["errors"]) + "".join(f", {n} {kind}" for kind, n in r["errors_by_kind"].items())
        busy = f"{r['generator_busy']:.0%}" + ("" if r["driven"] else " (its limit: not the server's)")
        where = f"{lv.device or 'unknown (a server at a URL)'}, {lv.precision or 'unknown'}"
        where += f", HTTP in {lv.front_ends} processes" if lv.front_ends else ""
        lines.append(
            f"{f'| {lv.server} ' * servers}| {where} | {'open' if r['mode'] == 'rate' else 'closed'} | "
            f"{r['level']:g} {unit} | "
            f"{r['requests']} | {r['ok']} | {errors} | {r['throughput_per_s']} | {r['p50_ms']} | {r['p95_ms']} | "
            f"{r['p99_ms']} | {dash(r['rows_per_call'])} | {dash(r['queue_ms'])} | {busy} | "
            f"{dash(r['generator_ceiling_per_s'])} | {energy} |"
        )
    for name, why in (missing or {}).items():
        lines.append(f"| {name} | {why} |" + " |" * 14)
    return "\n".join(lines)


def report(targets: list[Target], levels: list[Level], slo_ms: float, missing: dict[str, str] | None = None) -> dict:
    """frugality's levels and saturation (what `cost serve --from` reads), and each peer's;
    `missing`: peers asked for that could not run, and why."""
    main, *peers = targets
    return _figures(main, levels, slo_ms) | {
        "slo_ms": slo_ms,
        "generator": "plain asyncio, one kept-alive connection per client (frugality.bench.load)",
        "loop": loop_name(),  # (the generator's event loop: uvloop where installed)
        "peers": [_figures(p, levels, slo_ms) for p in peers]
        + [{"server": name, "missing": why} for name, why in (missing or {}).items()],
    }


def _figures(target: Target, levels: list[Level], slo_ms: float) -> dict:
    own = [lv for lv in levels if lv.server == target.name]
    best = saturation(own, slo_ms)
    rates = [lv.level for lv in own if lv.mode == "rate"]
    return {
        "server": target.name,
        # every rate tried met the SLO: the capacity is at least the saturation, not it
        "saturation_is_lower_bound": best is not None and best["level"] == max(rates),
        "url": target.url,
        "model": target.model,
        "endpoint": target.endpoint,
        "precision": target.precision,
        "device": target.device,
        "levels": [lv.row() for lv in own],
        "saturation": None
        if best is None
        else {
            "rate_per_s": best["level"],
            "throughput_per_s": best["throughput_per_s"],
            "p99_ms": best["p99_ms"],
            "watts": best["watts"],
            "joules_per_request": None if best["joules_per_1000"] is None else best["joules_per_1000"] / 1000,
            "energy": best["energy"],
        },
    }


def dumps(result: dict) -> str:
    return json.dumps(result, indent=2)
