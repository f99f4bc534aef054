"""The servers `bench serve --peer` races frugality's against, each on the same model, device
and precision, in an environment of its own (`./scripts/setup.sh --peers` makes them):

- `infinity`: infinity-emb (FastAPI, a batching handler with a tokenizer thread), what users
  would otherwise run to serve an embedding model from Python. It pins numpy < 2 and
  sentence-transformers < 4, hence `.venv-infinity`. Started as its README starts it
  (`infinity_emb v2`), its defaults kept (batch size 32), on the loopback, its routes under
  `/v1` as OpenAI's, no telemetry.

A peer that cannot run is not an error: the table gets a row saying why and how to install it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

SETUP = "./scripts/setup.sh --peers makes .venv-infinity"
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8"}  # frugality's precision: infinity's --dtype


def find_venv(name: str) -> Path | None:
    """`name` (a venv folder) in the current folder, else beside frugality's own checkout."""
    import frugality

    for root in (Path.cwd(), Path(frugality.__file__).resolve().parents[2]):
        if (root / name / "bin" / "python").exists():
            return root / name
    return None


def start_infinity(model: str, precision: str | None, device: str, log):
    """infinity-emb serving `model` on `device` (cpu, cuda, cuda:1) in frugality's `precision`
    (its name: fp32, bf16, int8; int8 is infinity's own quantization): a started `Target`, or
    why it could not start (one line)."""
    from frugality.bench.serve import Target

    venv = find_venv(".venv-infinity")
    if venv is None or not (venv / "bin" / "infinity_emb").exists():
        return f"not installed: {SETUP}"
    version = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import importlib.metadata as m; print(m.version('infinity-emb'))"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    with socket.socket() as s:  # a free port (infinity takes no port 0)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kind, _, index = device.partition(":")
    dtype = _DTYPES.get(precision or "", "auto")
    command = [str(venv / "bin" / "infinity_emb"), "v2", "--model-id", model, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--url-prefix", "/v1", "--engine", "torch", "--device", kind, "--dtype", dtype]
    command += ["--device-id", index] if index else []
    log(f"starting: infinity_emb v2 --model-id {model} --device {device} --dtype {dtype} (infinity-emb {version})")
    env = os.environ | {"DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0", "HF_HUB_OFFLINE": "1"}
    out = tempfile.NamedTemporaryFile("w+", prefix="bench-serve-infinity-", suffix=".log")  # noqa: SIM115
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    target = None
    try:  # stopped however the wait ends (Ctrl-C included)
        deadline = time.monotonic() + 600
        while True:
            if process.poll() is not None:
                said = [line for line in Path(out.name).read_text(errors="replace").splitlines() if line.strip()]
                return f"infinity-emb {version} ended with status {process.returncode}: {said[-1] if said else ''}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                return f"infinity-emb {version}: not ready after 600 s"
            time.sleep(0.5)
        target = Target(f"http://127.0.0.1:{port}", None, [], log, name=f"infinity-emb {version}")
    finally:
        if target is None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert target is not None  # (each other way out returned or raised above)
    target.process, target.log = process, out
    target.precision = dtype  # (the --dtype it was started with, in its own words)
    target.device = f"{device} (its --device)"
    return target
