"""XLA from the main environment: the XLA tests (tests/xla) run in .venv-xla, the only place
torch_xla can be (torch 2.9.0 + torch-xla 2.9.0), started from here so that the README's test
command covers them; and a bad XLA set-up is one line, exit 2."""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
XLA_PYTHON = ROOT / ".venv-xla" / "bin" / "python"


@pytest.mark.timeout(1800)  # (the slowest CPU kind, with empty caches)
def test_the_xla_tests_pass_in_their_environment(xla_tests):
    if importlib.util.find_spec("torch_xla") is not None:
        pytest.skip("this is the XLA environment: tests/xla run here directly")
    assert XLA_PYTHON.exists(), "no .venv-xla here: ./scripts/setup.sh --test (or --xla) makes it"
    has_xla = subprocess.run([str(XLA_PYTHON), "-c", "import torch_xla"], capture_output=True).returncode == 0
    if not has_xla and (sys.platform != "linux" or platform.machine() != "x86_64"):
        pytest.skip("torch-xla has wheels for Linux x86-64 only")
    assert has_xla, ".venv-xla has no torch_xla: ./scripts/setup.sh --xla installs it"
    # started with the session (tests/conftest.py), in .venv-xla, on XLA's CPU client
    returncode = xla_tests.wait(timeout=900)
    out = xla_tests.log.read_text()
    assert returncode == 0 and " passed" in out, out[-6000:]
    assert "skipped" not in out.strip().splitlines()[-1], out[-2000:]  # each one ran


def _train_on_xla(micro_recipe_file, tmp_path, **env):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "frugality",
            "train",
            str(micro_recipe_file),
            "--run-dir",
            str(tmp_path / "run"),
            "--set",
            "train.device=xla",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed here")
def test_an_xla_device_without_torch_xla_or_with_a_mismatched_one_is_one_line(micro_recipe_file, tmp_path):
    missing = _train_on_xla(micro_recipe_file, tmp_path)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        "error: an xla device needs torch_xla, which this environment lacks; ./scripts/setup.sh --xla "
        "(a .venv-xla with torch 2.9.0 and torch-xla 2.9.0)"
    ]
    fake = tmp_path / "fake" / "torch_xla"  # what a torch_xla built for another torch does on import
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("_XLAC.so: undefined symbol: _ZN5torch8autograd")\n')
    mismatched = _train_on_xla(micro_recipe_file, tmp_path, PYTHONPATH=str(fake.parent))
    [line] = mismatched.stderr.strip().splitlines()
    assert mismatched.returncode == 2 and line.startswith("error: torch_xla does not import with torch ")
    assert "undefined symbol" in line and "pairs with one torch version" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_commands_that_do_not_run_on_xla_yet_say_so_in_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "frugality", "bench", "train", "tiny", "--set", "train.device=xla"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    [line] = done.stderr.strip().splitlines()
    assert done.returncode == 2 and line == (
        "error: train.device: 'xla': frugality bench does not run on an xla device yet "
        "(train, compile, embed, generate and doctor do; docs/xla.md)"
    )


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed here")
def test_bench_train_on_xla_outside_its_environment_is_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "frugality", "bench", "train", "tiny", "--device", "xla"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: bench train --device xla runs in the XLA environment: .venv-xla/bin/frugality (docs/xla.md)"
    ]
