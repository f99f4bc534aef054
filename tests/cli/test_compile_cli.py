"""`frugality compile` then `frugality train`, as separate processes the way a user runs
them: a `tiny` run after the ahead-of-time compile compiles nothing (its step count is
not part of the graphs' key, so a shortened run proves what the full one would)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from frugality.cli.main import main

FRUGALITY = str(Path(sys.executable).with_name("frugality"))


def _run(*args, env):
    return subprocess.run([FRUGALITY, *args], capture_output=True, text=True, env=env)


def test_compile_then_a_tiny_run_compiles_nothing(tmp_path):
    env = os.environ | {"FRUGALITY_COMPILE_CACHE": str(tmp_path / "compile-cache")}
    done = _run("compile", "tiny", "--level", "O1", "--no-progress", env=env)
    assert done.returncode == 0, done.stderr
    # The block's forward and backward and the evaluation forward; on GPUs also the
    # cross-entropy's compiled row pass, with and without the gradient.
    graphs = 5 if torch.cuda.is_available() else 3
    assert f"{graphs} graphs (0 already cached, {graphs} compiled)" in done.stdout
    assert "recompiles 0" in done.stdout
    assert not list(Path.cwd().glob("runs/tiny*"))  # throwaway state only

    run_dir = tmp_path / "run"
    done = _run("train", "tiny", "--set", "compile.level=O1", "--set", "train.steps=24", "--set",
                "train.eval_interval=12", "--run-dir", str(run_dir), "--no-progress", env=env)
    assert done.returncode == 0, done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    compiled = summary["compile"]
    assert compiled["fetched"] and compiled["cache_hits"] == graphs
    assert compiled["cache_misses"] == 0 and compiled["recompiles"] == 0  # the guard saw nothing
    assert summary["final_step"] == 24
    assert summary["final_val_loss"] < 0.9 * summary["first_val_loss"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "compile"] == [0, 1, 24]


def test_bad_compile_settings_are_one_line(micro_recipe_file, tmp_path, capsys):
    assert main(["train", str(micro_recipe_file), "--set", "compile.on_recompile=sometimes",
                 "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --set compile.on_recompile=sometimes: compile.on_recompile: Input should be "
                   "'warn' or 'error' (got 'sometimes')"]
    assert not (tmp_path / "run").exists()
    assert main(["compile", str(micro_recipe_file)]) == 2
    assert "nothing to compile" in capsys.readouterr().err
