"""Running the server: the socket bound first (a port in use is one line), the model loaded
and warmed in the background while `/health` answers 503, then uvicorn until SIGTERM or
Ctrl-C: it stops accepting, lets what is in flight finish (up to `drain_s`), and the
command exits 0."""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from frugality.errors import UserError
from frugality.models.families import SPECS
from frugality.serve.app import State, build_app
from frugality.serve.edge import QuietCancel
from frugality.serve.metrics import ServeMetrics
from frugality.serve.protocol import Limits
from frugality.training.run_dir import held

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ServeSettings:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    name: str | None = None  # the model's name in the API [default: the folder's name]
    device: str = "auto"
    precision: str = "auto"
    max_wait_ms: float | None = None  # an idle model waits that long for company [embeddings 0, completions 5]
    max_queue: int = 256
    batch_tokens: int | None = None  # embeddings: tokens a model call [default: embed's, for the device]
    rows: int = 8  # completions: rows decoding at once
    context: int | None = None  # completions: positions a row holds [default: the model's]
    drain_s: float = 30.0
    api_key_env: str | None = None
    limits: Limits = Limits()
    runs_dir: str = "runs"  # where `frugality top` finds it: RUNS/serve-NAME-PORT (a lock and a log)
    compile: bool = False  # completions: the prefill and decoding step compiled (Inductor; CUDA graphs on a GPU)
    workers: int = 1  # embeddings: front-end processes for HTTP (serve.workers); 1: all in this one
    streams: int = 1  # embeddings on a CPU: model calls at once, each on its share of the cores


def _refuse_streams(settings: ServeSettings, family: str, device) -> None:
    """`--streams N` where it cannot run, in one line, before the port is taken or the model
    loaded."""
    import torch

    from frugality.backends import backend

    n = settings.streams
    if SPECS[family].decoder:
        raise UserError(f"--streams {n}: embeddings only (a decoder's rows decode in one batch)")
    if not backend(device).on_host:
        raise UserError(f"--streams {n}: CPUs only, not {device.type}; add --device cpu")
    if n > (threads := torch.get_num_threads()):
        raise UserError(f"--streams {n}: more than the {threads} threads torch runs here (a stream takes one at least)")
    if settings.precision == "int8":
        from frugality.inference.encoder import int8_engine

        if int8_engine(device)[0] == "onnxruntime":
            raise UserError(
                f"--streams {n}: not with int8 in ONNX Runtime (its own thread pool spans every core); "
                "use FRUGALITY_INT8_ENGINE=torch, or one stream"
            )


def model_family(path: str) -> str:
    """The family of the model at `path` (read before its weights are built)."""
    from frugality.inference.encoder import load_model

    class Found(Exception):
        pass

    def peek(config, folder):
        raise Found(config.family)

    try:
        load_model(path, peek)
    except Found as found:
        return found.args[0]
    raise UserError(f"model {path}: its family could not be read")


def serve(settings: ServeSettings, log=lambda line: print(line, file=sys.stderr, flush=True)) -> int:
    import uvicorn  # (the command checked the extra is installed)

    api_key = None
    if settings.api_key_env:
        api_key = os.environ.get(settings.api_key_env)
        if not api_key:
            raise UserError(f"--api-key-env {settings.api_key_env}: that environment variable is empty or unset")
    if not Path(settings.model).exists():
        raise UserError(f"model {settings.model}: no such folder")
    family = model_family(settings.model)  # a model neither kind is refused before the port is taken
    if family not in SPECS:
        raise UserError(f"model {settings.model}: a {family} model; serve takes an encoder or a decoder")
    from frugality.metrics.energy import open_meter
    from frugality.runtime.device import resolve_device

    device = resolve_device(settings.device, key="--device", what="frugality serve", xla_ok=True)
    if settings.compile and not SPECS[family].decoder:
        raise UserError(
            "--compile: completions only (an encoder's batches, any number of texts of any length, run eagerly)"
        )
    if settings.workers > 1 and SPECS[family].decoder:
        raise UserError(
            f"--workers {settings.workers}: embeddings only (a decoder's completions are served by one process)"
        )
    if settings.streams > 1:
        _refuse_streams(settings, family, device)
    if settings.compile:
        from frugality.inference.generate import refuse_compile_where_traced

        refuse_compile_where_traced(device)
    meter, _ = open_meter(device.type, device.index)
    meter.start()
    name = settings.name or Path(settings.model).resolve().name
    state = State(name, settings.limits, ServeMetrics(meter), api_key)
    sock = _bind(settings.host, settings.port, listen=settings.workers == 1)
    host, port = sock.getsockname()[:2]
    where = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
    exposed = "" if settings.host in LOOPBACK else " (not loopback: anyone who can reach this address can call it)"
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "model"  # (a name is not a path)
    run_dir = Path(settings.runs_dir) / f"serve-{safe}-{port}"
    with held(run_dir, "or serve on another --port"):
        return _run(settings, family, device, state, sock, where, exposed, name, run_dir, log, uvicorn)


def _run(settings, family, device, state, sock, where, exposed, name, run_dir, log, uvicorn) -> int:
    if settings.workers > 1:
        return _run_front_ends(settings, family, device, state, sock, where, exposed, name, run_dir, log)
    log(f"frugality serve: {name} on {where}{exposed}; loading the model (GET /health: 503 until ready)")
    config = uvicorn.Config(
        build_app(state),
        log_level="warning",
        timeout_graceful_shutdown=settings.drain_s or 0.001,  # (uvicorn: None would wait forever)
        lifespan="off",
    )
    server = uvicorn.Server(config)
    state.stopping, state.log = (lambda: server.should_exit), log
    quiet = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, QuietCancel) for f in quiet.filters):  # (once a process)
        quiet.addFilter(QuietCancel())
    loader = threading.Thread(target=_load, args=(settings, family, device, state, log, where, server), daemon=True)
    loader.start()
    # uvicorn catches SIGTERM and SIGINT while it runs (stop accepting, drain) and raises
    # them again once done, to the handlers found before: these, which let the command end 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    reporting = threading.Event()
    every_s = float(os.environ.get("FRUGALITY_SERVE_REPORT_S", "5"))  # (tests: shorter)
    reporter = threading.Thread(target=_report, args=(state, run_dir, where, reporting, every_s), daemon=True)
    reporter.start()
    try:
        server.run(sockets=[sock])
    finally:
        reporting.set()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # drained: a second signal ends the process at once
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if state.problem:
        raise UserError(state.problem)
    if state.service is not None:
        state.service.close()  # what was queued when the drain ended has been answered
    log(f"frugality serve: stopped ({_counted(state)})")
    return 0


def _run_front_ends(settings, family, device, state, sock, where, exposed, name, run_dir, log) -> int:
    """`_run` with the HTTP API in `settings.workers` processes (serve.workers) and the
    model here: they start while it loads, hear "ready" (and say they did) before the
    ready line, and on SIGTERM or SIGINT drain as one server does; then the service stops."""
    import multiprocessing

    from frugality.serve.workers import FrontEnd, front_end

    n = settings.workers
    log(
        f"frugality serve: {name} on {where}{exposed}; loading the model in this process, HTTP in {n} "
        "front-end processes (GET /health: 503 until ready)"
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # (a terminal's Ctrl-C reaches the front ends too)
        signal.signal(sig, lambda *_: stop.set())
    spawn = multiprocessing.get_context("spawn")  # (a fresh interpreter: no torch, no model, no threads)
    processes, fronts = [], []
    for i in range(n):
        ours, theirs = spawn.Pipe()
        address = sock.getsockname()[:2]
        args = (address, theirs, state.name, state.limits, state.api_key, state.created, settings.drain_s)
        process = spawn.Process(target=front_end, args=args, name=f"frugality-serve-{i + 1}", daemon=True)
        process.start()
        theirs.close()
        processes.append(process)
        fronts.append(FrontEnd(ours, state))

    def told_ready() -> bool:  # each front end's routes take requests before the ready line
        for front in fronts:
            front.tell("ready")
        for front, process in zip(fronts, processes, strict=True):
            while not front.acknowledged.wait(0.05):
                if not process.is_alive() or stop.is_set():
                    return False
        return True

    stopper = SimpleNamespace(should_exit=False)  # (what `_load` sets on a failure: read below)
    loader = threading.Thread(
        target=_load, args=(settings, family, device, state, log, where, stopper, told_ready), daemon=True
    )
    loader.start()
    reporting = threading.Event()
    every_s = float(os.environ.get("FRUGALITY_SERVE_REPORT_S", "5"))
    threading.Thread(target=_report, args=(state, run_dir, where, reporting, every_s), daemon=True).start()
    ended = None
    while not stop.wait(0.1) and not stopper.should_exit:
        ended = next((p for p in processes if not p.is_alive()), None)
        if ended is not None:
            break
    if state.problem:
        for front in fronts:
            front.tell("failed", state.problem)
    for process in processes:
        if process.is_alive() and process.pid is not None:
            os.kill(process.pid, signal.SIGTERM)  # each drains what it has in flight
    deadline = time.monotonic() + settings.drain_s + 10  # (the drains run side by side: one deadline)
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
    for front in fronts:
        front.join(5)  # (its last counts read: its pipe closed with its process)
    reporting.set()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if state.problem:
        raise UserError(state.problem)
    if state.service is not None:
        state.service.close()
    if ended is not None:
        raise UserError(f"front end {ended.name} ended (exit status {ended.exitcode}); the server stopped")
    log(f"frugality serve: stopped ({_counted(state)})")
    return 0


def _bind(host: str, port: int, listen: bool = True) -> socket.socket:
    """The listening socket; with `listen` False, the port held for `--workers`' front ends,
    each of which listens on a socket of its own (`serve.workers.listener`)."""
    from frugality.serve.workers import listener

    try:
        sock = listener(host, port, reuse_port=False)
        if not listen:  # the port found free (any other socket on it refuses this bind), then held
            port = sock.getsockname()[1]
            sock.close()
            sock = listener(host, port, reuse_port=True)  # bound, never listening: no connection waits on it
    except OSError as e:
        raise UserError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    if listen:
        sock.listen(2048)
    return sock


def _load(settings: ServeSettings, family: str, device, state: State, log, where, server, before_ready=None) -> None:
    try:
        if not SPECS[family].decoder:  # an encoder: embeddings
            from frugality.inference.batches import batch_defaults
            from frugality.inference.encoder import load_encoder
            from frugality.serve.embeddings import EmbeddingService

            encoder, why = load_encoder(
                settings.model, device, settings.precision, max_length=settings.limits.max_input_tokens
            )
            tokens, rows = batch_defaults(encoder)
            service = EmbeddingService(
                encoder,
                state.metrics,
                settings.max_wait_ms or 0.0,  # (what is queued goes at once: TEI and vLLM wait for nothing either)
                settings.max_queue,
                settings.batch_tokens or tokens,
                rows,
                settings.streams,
            )
            service.submit(["warm-up"]).result()
        else:
            from frugality.inference.generate import Sampling, load_decoder
            from frugality.serve.completions import CompletionService

            # (Inductor compiles plain layers, not oneDNN's packed ones)
            decoder, why = load_decoder(settings.model, device, settings.precision, pack=not settings.compile)
            context = settings.context or decoder.max_seq_len
            service = CompletionService(
                decoder,
                state.metrics,
                5.0 if settings.max_wait_ms is None else settings.max_wait_ms,  # (as before; not measured at 0)
                settings.max_queue,
                settings.rows,
                context,
                "inductor" if settings.compile else None,
            )
            # three tokens: two decoding steps, so that a compiled step's CUDA graph, warmed up at
            # its first call, is recorded at its second, before the server is ready
            service.submit(service.tokenize(["warm-up"], 3)[0], Sampling(max_new_tokens=3)).result()
    except Exception as e:  # the server stops, and the command says why in one line
        state.problem = str(e) if isinstance(e, UserError) else f"model {settings.model}: {type(e).__name__}: {e}"
        server.should_exit = True
        return
    # the loaded heap (torch, the model, the app: ~300k objects) out of the collector's sight: a
    # full collection over it paused every request ~175 ms (2-core EPYC), the p95 at 64 clients
    # (vLLM's API server does the same)
    gc.collect()
    gc.freeze()
    state.service = service
    if before_ready is not None and not before_ready():
        return  # (a front end ended, or the server is stopping: not ready)
    path = "/v1/completions" if SPECS[family].decoder else "/v1/embeddings"
    from frugality.hardware import device_name

    # (the device last: `bench serve` names it in every row)
    streams = getattr(service, "streams_line", "")  # (embeddings on a CPU in streams)
    log(f"frugality serve: ready, POST {where}{path} ({why}){streams}; device: {device} ({device_name(device)})")


def _answered(state: State) -> int:
    total = 0
    for metric in state.metrics.requests.collect():
        total += sum(int(s.value) for s in metric.samples if s.name.endswith("_total"))
    return total


def _counted(state: State) -> str:
    return f"{_answered(state)} requests answered"


def _report(state: State, run_dir: Path, where: str, stop: threading.Event, every_s: float = 5.0) -> None:
    """A `serve` record in RUN_DIR/metrics.jsonl every few seconds: the address, requests
    answered, and their rate over the last interval (`frugality top` shows the last)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("")  # this server's records only (a name and port reused)
    before, then = _answered(state), time.monotonic()
    first = True
    while first or not stop.wait(every_s):  # a first record at once: top shows a server, not a run starting
        first = False
        now, count = time.monotonic(), _answered(state)
        record = {
            "kind": "serve",
            "time": round(time.time(), 3),
            "url": where,
            "ready": state.service is not None,
            "requests": count,
            "requests_per_s": round((count - before) / (now - then), 3) if now > then else 0.0,
        }
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        before, then = count, now
