"""One writer per run directory: a second `frugality train` on a directory in use stops with
one line naming the first, and the first ends as if it had been alone; a lock left by a
process that died is taken over with a warning."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import forked_cli
import pytest
from test_trainer import _assert_identical, _final_state, _train_losses

from frugality.config.recipe import load_recipe
from frugality.errors import FrugalityWarning
from frugality.training import loop, trainer
from frugality.training.run_dir import lock_path


@pytest.mark.slow
def test_a_second_train_on_a_directory_in_use_exits_2_naming_the_first(
    micro_recipe_file, tmp_path, monkeypatch, micro_reference_run
):
    recipe = load_recipe(str(micro_recipe_file))
    alone = micro_reference_run
    second = []
    real = loop.train_step

    def step(state, batches, **kw):
        if state.step == 5:  # the first run is mid-way, with a checkpoint at step 4: start a second
            second.append(forked_cli.run("train", micro_recipe_file, "--run-dir", tmp_path / "shared", "--no-progress"))
        return real(state, batches, **kw)

    monkeypatch.setattr(loop, "train_step", step)
    trainer.train(recipe, run_dir=tmp_path / "shared", progress=False, tensorboard=False)
    done = second[0]
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(
        f"error: run directory {tmp_path / 'shared'} is in use by PID {os.getpid()} on {os.uname().nodename} (started "
    )
    assert line.endswith(
        f"(lock {lock_path(tmp_path / 'shared')}); wait for it to end, or train into another --run-dir"
    )
    # the first run's checkpoints, metrics and summary are those of a run alone
    _assert_identical(_final_state(recipe, alone), _final_state(recipe, tmp_path / "shared"))
    assert _train_losses(alone) == _train_losses(tmp_path / "shared")
    assert json.loads((tmp_path / "shared" / "summary.json").read_text())["final_step"] == 8
    # nothing moved aside, and no lock left behind: the run directories and the recipe
    assert sorted(p.name for p in tmp_path.iterdir()) == ["micro.toml", "shared"]


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_warning(micro_recipe_file, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock_path(tmp_path / "run").write_text(
        json.dumps({"host": os.uname().nodename, "pid": dead.pid, "started": "2026-11-23T01:02:03"})
    )
    recipe = load_recipe(str(micro_recipe_file), ["train.steps=2", "optim.warmup_steps=1"])
    with pytest.warns(FrugalityWarning, match=f"taking over from PID {dead.pid}"):
        trainer.train(recipe, run_dir=tmp_path / "run", progress=False, tensorboard=False)
    assert not lock_path(tmp_path / "run").exists()  # released and removed at the end
