"""`--retries`: a run killed mid-way is rerun from its last valid checkpoint and ends with
the uninterrupted run's bits; attempts are recorded with goodput; a run that keeps dying
without a checkpoint is given up with exit status 4."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_trainer import _assert_identical, _final_state, _train_losses

from frugality.config.recipe import load_recipe
from frugality.training.supervisor import GAVE_UP_EXIT, supervise

DIES = """
import os, signal, sys
from pathlib import Path
from frugality.config.recipe import load_recipe
from frugality.training import loop, trainer
recipe_file, run_dir, at_step, marker = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
real = loop.train_step
def step(state, batches, **kw):
    if state.step + 1 == at_step and (marker.name == "always" or not marker.exists()):
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a lost node would
    return real(state, batches, **kw)
loop.train_step = step
fresh = "--fresh" in sys.argv[5:]  # as `frugality train` takes it: the supervisor's rerun may add it
trainer.train(load_recipe(recipe_file), run_dir=run_dir, fresh=fresh, progress=False, tensorboard=False)
"""


def _script(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(DIES)
    return script


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_checkpoint_to_the_uninterrupted_bits(
    micro_recipe_file, tmp_path, micro_reference_run
):
    recipe = load_recipe(str(micro_recipe_file))  # 8 steps, checkpoints at 4 and 8
    run = tmp_path / "run"
    command = [sys.executable, str(_script(tmp_path)), str(micro_recipe_file), str(run), "6", str(tmp_path / "once")]
    assert supervise(command, run, retries=2, backoff_s=0) == 0
    _assert_identical(_final_state(recipe, micro_reference_run), _final_state(recipe, run))
    assert _train_losses(micro_reference_run) == _train_losses(run)
    attempts = [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines()]
    assert [
        (a["cause"], a["checkpoint_before"], a["checkpoint_after"], a["last_logged_step"], a["recomputed_steps"])
        for a in attempts
    ] == [("killed by signal 9", 0, 4, 5, 1), ("finished", 4, 8, 8, 0)]
    summary = json.loads((run / "summary.json").read_text())
    goodput = summary["goodput"]
    assert summary["attempts"] == 2 and goodput["recomputed_steps"] == 1
    assert 0 < goodput["productive_s"] < goodput["wall_s"]
    # computed before the times were rounded for the file: equal to their ratio within that rounding
    assert goodput["goodput"] == pytest.approx(goodput["productive_s"] / goodput["wall_s"], abs=2e-4)


@pytest.mark.slow
def test_a_run_that_dies_before_its_first_checkpoint_starts_over_with_its_files_kept_aside(micro_recipe_file, tmp_path):
    run = tmp_path / "run"
    command = [sys.executable, str(_script(tmp_path)), str(micro_recipe_file), str(run), "2", str(tmp_path / "once")]
    assert supervise(command, run, retries=2, backoff_s=0, log=lambda *a, **k: None) == 0
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith("run.prev-")]
    assert _train_losses(aside) == {1: _train_losses(run)[1]}  # the first attempt's one step, the same
    assert not (aside / "checkpoints").exists() or not any((aside / "checkpoints").iterdir())
    attempts = [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines()]
    assert [(a["cause"], a["checkpoint_after"]) for a in attempts] == [("killed by signal 9", 0), ("finished", 8)]


@pytest.mark.slow
def test_a_run_that_dies_before_any_checkpoint_twice_is_given_up(micro_recipe_file, tmp_path):
    run = tmp_path / "run"
    command = [sys.executable, str(_script(tmp_path)), str(micro_recipe_file), str(run), "2", str(tmp_path / "always")]
    assert supervise(command, run, retries=5, backoff_s=0, log=lambda *a, **k: None) == GAVE_UP_EXIT
    assert len((run / "attempts.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow
def test_train_retries_supervises_the_same_command(micro_recipe_file, tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "frugality",
            "train",
            str(micro_recipe_file),
            "--run-dir",
            str(tmp_path / "run"),
            "--no-progress",
            "--retries",
            "2",
            "--set",
            "train.steps=2",
            "--set",
            "optim.warmup_steps=1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    [attempt] = [json.loads(line) for line in (tmp_path / "run" / "attempts.jsonl").read_text().splitlines()]
    assert attempt["cause"] == "finished" and attempt["checkpoint_after"] == 2
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["attempts"] == 1
