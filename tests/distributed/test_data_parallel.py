"""Data parallelism on torchrun with 2 CPU processes over gloo: the same losses as one
process taking both ranks' samples, and checkpoints that resume at another world size."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from pathlib import Path


def _train(recipe_file, run_dir, nproc: int, *overrides: str) -> subprocess.CompletedProcess:
    frugality = ["-m", "frugality", "train", str(recipe_file), "--run-dir", str(run_dir), "--no-progress",
                 *(a for o in overrides for a in ("--set", o))]
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
              if nproc > 1 else [sys.executable])
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(launch + frugality, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _losses(run_dir, kind="train") -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == kind}


@pytest.mark.parametrize("strategy, precision, tolerance", [
    ("ddp", "fp32", 1e-5), ("fsdp", "fp32", 1e-5),
    ("ddp", "bf16-sr", 1e-3),  # gradients all-reduced in bf16
])
def test_two_ranks_train_as_one_process_with_both_shares(micro_recipe_file, tmp_path, strategy, precision,
                                                          tolerance):
    """Micro-batches of 2 on each of 2 ranks = 2 accumulated micro-batches of 2 in one process."""
    _train(micro_recipe_file, tmp_path / "one", 1, f"train.precision={precision}")
    done = _train(micro_recipe_file, tmp_path / "two", 2, f"parallel.data={strategy}", f"train.precision={precision}")
    assert f"{strategy} over 2 processes" in done.stdout
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(two) == list(range(1, 9))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=tolerance), step
    assert _losses(tmp_path / "two", "eval") == pytest.approx(_losses(tmp_path / "one", "eval"), rel=tolerance)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["final_step"] == 8 and summary["tokens_seen"] == 8 * 4 * 32


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_run_saved_at_two_ranks_resumes_in_one_process(micro_recipe_file, tmp_path, strategy):
    """The data position is global: the resumed run takes the samples the straight one did."""
    _train(micro_recipe_file, tmp_path / "straight", 1)
    _train(micro_recipe_file, tmp_path / "moved", 2, f"parallel.data={strategy}")
    # take the two-rank run back to its step-4 checkpoint and continue it in one process
    shutil.rmtree(tmp_path / "moved" / "checkpoints" / "step_00000008")
    _train(micro_recipe_file, tmp_path / "moved", 1)
    straight, moved = _losses(tmp_path / "straight"), _losses(tmp_path / "moved")
    assert sorted(moved) == list(range(1, 9))
    for step in range(5, 9):
        assert moved[step] == pytest.approx(straight[step], rel=1e-4), step


def test_frugality_train_nproc_starts_the_processes_itself(micro_recipe_file, tmp_path):
    frugality = str(Path(sys.executable).with_name("frugality"))
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([frugality, "train", str(micro_recipe_file), "--run-dir", str(tmp_path / "run"),
                           "--no-progress", "--nproc", "2", "--set", "train.steps=4"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ddp over 2 processes" in done.stdout and done.stdout.count("step 4/4") == 1  # rank 0 reports
    assert sorted(_losses(tmp_path / "run")) == [1, 2, 3, 4]


KILLED = """
import os, sys
from frugality.config.recipe import load_recipe
from frugality.training import loop, trainer
real = loop.train_step
def step(state, batches):
    if state.step == 2 and state.world.rank == 1:
        os._exit(9)  # the process dies mid-run, as on a lost node
    return real(state, batches)
loop.train_step = step
trainer.train(load_recipe(sys.argv[1]), run_dir=sys.argv[2], progress=False, tensorboard=False)
"""


def test_a_rank_that_dies_ends_the_run_naming_it(micro_recipe_file, tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), str(micro_recipe_file), str(tmp_path / "run")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0
    assert "rank      : 1" in done.stderr and "exitcode  : 9" in done.stderr


def test_a_run_saved_in_one_process_resumes_on_two_ranks(micro_recipe_file, tmp_path):
    _train(micro_recipe_file, tmp_path / "straight", 1)
    frugality = [sys.executable, "-m", "frugality", "train", str(micro_recipe_file), "--run-dir",
                 str(tmp_path / "grown"), "--no-progress", "--until-step", "4"]
    assert subprocess.run(frugality, capture_output=True, text=True, timeout=600).returncode == 0
    done = _train(micro_recipe_file, tmp_path / "grown", 2)
    assert "resuming" in done.stdout
    straight, grown = _losses(tmp_path / "straight"), _losses(tmp_path / "grown")
    assert sorted(grown) == list(range(1, 9))
    for step in range(5, 9):
        assert grown[step] == pytest.approx(straight[step], rel=1e-4), step
