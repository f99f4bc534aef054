"""Data parallelism on torchrun with 2 CPU processes over gloo: the same losses as one
process taking both ranks' samples, and checkpoints that resume at another world size."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest


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


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_train_as_one_process_with_both_shares(micro_recipe_file, tmp_path, strategy):
    """Micro-batches of 2 on each of 2 ranks = 2 accumulated micro-batches of 2 in one process."""
    _train(micro_recipe_file, tmp_path / "one", 1)
    done = _train(micro_recipe_file, tmp_path / "two", 2, f"parallel.data={strategy}")
    assert f"{strategy} over 2 processes" in done.stdout
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(two) == list(range(1, 9))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-5), step
    assert _losses(tmp_path / "two", "eval") == pytest.approx(_losses(tmp_path / "one", "eval"), rel=1e-5)
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
