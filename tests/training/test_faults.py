"""The fault injector the reliability suite (benchmarks/faults.py) drives, through the real
command: a SIGKILL mid-save recovered by --retries to the uninterrupted run's bits, and a
malformed fault named. (A full disk mid-save: tests/checkpoint/test_verified.py; the
injector's other faults run in the benchmark.)"""

from __future__ import annotations

import os

import forked_cli
import pytest
from test_trainer import _assert_identical, _final_state, _train_losses

from frugality.config.recipe import load_recipe
from frugality.errors import UserError
from frugality.training.callbacks.faults import parse


def _train(recipe_file, run, fault, *args):
    env = dict(os.environ, FRUGALITY_INJECT_FAULT=fault)  # threads as in this process: the same sums
    return forked_cli.run("train", recipe_file, "--run-dir", run, "--no-progress", *args, env=env, timeout=300)


@pytest.mark.slow
def test_a_kill_while_saving_is_retried_to_the_uninterrupted_bits(micro_recipe_file, tmp_path, micro_reference_run):
    recipe = load_recipe(str(micro_recipe_file))  # 8 steps, checkpoints at 4 and 8
    done = _train(
        micro_recipe_file, tmp_path / "run", "kill_in_save@8", "--retries", "1", "--set", "train.retry_backoff_s=0"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "killed by signal 9" in done.stderr
    _assert_identical(_final_state(recipe, micro_reference_run), _final_state(recipe, tmp_path / "run"))
    assert _train_losses(micro_reference_run) == _train_losses(tmp_path / "run")


def test_a_malformed_fault_is_named():
    assert parse("hang@5:1") == ("hang", 5, 1)
    with pytest.raises(UserError, match="unknown fault 'explode'"):
        parse("explode@3")
    with pytest.raises(UserError, match="expected KIND@STEP"):
        parse("kill@soon")
