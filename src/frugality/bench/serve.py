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

import asyncio
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from frugality.errors import UserError


@dataclass
class Level:
    mode: str  # "rate" or "concurrency"
    level: float
    sent: int
    ok: int
    errors: int
    seconds: float
    latencies_ms: list[float]
    joules: float | None
    energy_kind: str | None

    def row(self) -> dict:
        lat = sorted(self.latencies_ms)
        q = lambda p: round(lat[max(0, math.ceil(p * len(lat)) - 1)], 1) if lat else None  # noqa: E731 (nearest rank)
        return {
            "mode": self.mode,
            "level": self.level,
            "requests": self.sent,
            "ok": self.ok,
            "errors": self.errors,
            "throughput_per_s": round(self.ok / self.seconds, 2) if self.seconds else None,
            "p50_ms": q(0.50),
            "p95_ms": q(0.95),
            "p99_ms": q(0.99),
            "seconds": round(self.seconds, 3),
            "joules_per_1000": round(self.joules / self.ok * 1000, 2) if self.joules is not None and self.ok else None,
            "watts": round(self.joules / self.seconds, 2) if self.joules is not None and self.seconds else None,
            "energy": self.energy_kind,
        }


class Target:
    """The endpoint under load: a URL, or a server started here for a model folder."""

    def __init__(self, target: str, api_key: str | None, serve_args: list[str], log) -> None:
        self.process = None
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if re.match(r"https?://", target):
            self.url = target.rstrip("/").removesuffix("/v1")
        else:
            if not os.path.exists(target):
                raise UserError(f"{target}: neither a URL (http://...) nor a model folder")
            self.url = self._start(target, serve_args, log)
        import httpx

        try:
            models = httpx.get(f"{self.url}/v1/models", headers=self.headers, timeout=30)
        except httpx.HTTPError as e:
            self.stop()
            raise UserError(f"{self.url}: no server answers ({e})") from None
        if models.status_code != 200:
            self.stop()
            raise UserError(f"{self.url}/v1/models: HTTP {models.status_code} ({models.text[:200]})")
        self.model = models.json()["data"][0]["id"]
        self.endpoint = self._endpoint()

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
            ready = re.search(r"ready, POST (http://\S+?)/v1/", text)
            if ready:
                return ready.group(1)
            if self.process.poll() is not None:
                error = [line for line in text.splitlines() if line.startswith("error:")]
                raise UserError(f"frugality serve {model}: {error[-1].removeprefix('error: ') if error else 'ended'}")
            time.sleep(0.1)
        self.stop()
        raise UserError(f"frugality serve {model}: not ready after 600 s")

    def _endpoint(self) -> str:
        """embeddings or completions, asked of the server once it is ready."""
        import httpx

        deadline = time.monotonic() + 600
        while httpx.get(f"{self.url}/health", timeout=30).status_code != 200:
            if time.monotonic() > deadline:
                raise UserError(f"{self.url}/health: not ready after 600 s")
            time.sleep(0.5)
        probe = httpx.post(
            f"{self.url}/v1/embeddings", json={"model": self.model, "input": "probe"}, headers=self.headers, timeout=60
        )
        if probe.status_code == 200:
            return "embeddings"
        if probe.status_code == 404:
            return "completions"
        raise UserError(f"{self.url}/v1/embeddings: HTTP {probe.status_code} ({probe.text[:200]})")

    def joules(self) -> tuple[float | None, str | None]:
        import httpx

        try:
            text = httpx.get(f"{self.url}/metrics", timeout=30).text
        except httpx.HTTPError:
            return None, None
        for line in text.splitlines():
            if line.startswith("frugality_energy_joules_total{"):
                kind = re.search(r'kind="([^"]*)"', line)
                return float(line.rsplit(" ", 1)[1]), kind.group(1) if kind else None
        return None, None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=120)


def run_levels(
    target: Target,
    texts: list[str],
    rates: list[float],
    concurrencies: list[int],
    duration: float,
    max_tokens: int,
    seed: int,
    log,
) -> list[Level]:
    levels = []
    for rate in rates:
        levels.append(_measure(target, "rate", rate, texts, duration, max_tokens, seed))
        log(_line(levels[-1]))
    for clients in concurrencies:
        levels.append(_measure(target, "concurrency", clients, texts, duration, max_tokens, seed))
        log(_line(levels[-1]))
    return levels


def saturation(levels: list[Level], slo_ms: float) -> dict | None:
    """The highest open-loop rate whose p99 met the SLO with no errors, and its figures."""
    met = [
        lv.row()
        for lv in levels
        if lv.mode == "rate" and lv.errors == 0 and lv.latencies_ms and lv.row()["p99_ms"] <= slo_ms
    ]
    return max(met, key=lambda r: r["level"]) if met else None


def _line(level: Level) -> str:
    r = level.row()
    return (
        f"{r['mode']} {r['level']:g}: {r['ok']}/{r['requests']} ok, {r['throughput_per_s']} req/s, "
        f"p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms"
    )


def _measure(target: Target, mode: str, level: float, texts, duration, max_tokens, seed) -> Level:
    before, kind = target.joules()
    started = time.perf_counter()
    latencies, errors, sent = asyncio.run(_load(target, mode, level, texts, duration, max_tokens, seed))
    seconds = time.perf_counter() - started
    after, _ = target.joules()
    joules = after - before if before is not None and after is not None else None
    return Level(mode, level, sent, len(latencies), errors, seconds, latencies, joules, kind)


async def _load(target: Target, mode, level, texts, duration, max_tokens, seed):
    import httpx

    rng = random.Random(seed)
    latencies: list[float] = []
    errors = 0
    sent = 0

    def body(i: int) -> dict:
        text = texts[i % len(texts)]
        if target.endpoint == "embeddings":
            return {"model": target.model, "input": text}
        return {"model": target.model, "prompt": text, "max_tokens": max_tokens, "temperature": 0}

    async with httpx.AsyncClient(
        base_url=target.url,
        headers=target.headers,
        timeout=300,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
    ) as client:

        async def one(i: int, arrival: float) -> None:
            nonlocal errors
            try:
                response = await client.post(f"/v1/{target.endpoint}", json=body(i))
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                latencies.append((time.perf_counter() - arrival) * 1000)
            else:
                errors += 1

        start = time.perf_counter()
        if mode == "rate":
            tasks, at = [], 0.0
            while True:
                at += rng.expovariate(level)
                if at > duration:
                    break
                delay = start + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(sent, start + at)))
                sent += 1
            await asyncio.gather(*tasks)
        else:

            async def client_loop(k: int) -> None:
                nonlocal sent
                while time.perf_counter() - start < duration:
                    i = sent
                    sent += 1
                    await one(i, time.perf_counter())

            await asyncio.gather(*(client_loop(k) for k in range(int(level))))
    return latencies, errors, sent


def markdown_table(levels: list[Level]) -> str:
    lines = [
        "| mode | level | requests | ok | errors | req/s | p50 ms | p95 ms | p99 ms | J/1,000 requests |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in levels:
        r = lv.row()
        energy = "—" if r["joules_per_1000"] is None else f"{r['joules_per_1000']:,.1f} ({r['energy']})"
        unit = "req/s" if r["mode"] == "rate" else "clients"
        lines.append(
            f"| {'open' if r['mode'] == 'rate' else 'closed'} | {r['level']:g} {unit} | {r['requests']} | "
            f"{r['ok']} | {r['errors']} | {r['throughput_per_s']} | {r['p50_ms']} | {r['p95_ms']} | "
            f"{r['p99_ms']} | {energy} |"
        )
    return "\n".join(lines)


def report(target: Target, levels: list[Level], slo_ms: float) -> dict:
    best = saturation(levels, slo_ms)
    rates = [lv.level for lv in levels if lv.mode == "rate"]
    return {
        # every rate tried met the SLO: the capacity is at least the saturation, not it
        "saturation_is_lower_bound": best is not None and best["level"] == max(rates),
        "url": target.url,
        "model": target.model,
        "endpoint": target.endpoint,
        "slo_ms": slo_ms,
        "levels": [lv.row() for lv in levels],
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
