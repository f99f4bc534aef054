"""Runs of `frugality train` for the multi-process tests: in one process, or in several
started as torchrun starts them (gloo on CPU), and the losses a run logged."""

from __future__ import annotations

import json
import os
import subprocess

import forked_cli

STEPS = "train.steps=10"  # a model-parallel test's runs, and the one-process run each is compared with


def train(recipe_file, run_dir, nproc: int, *overrides: str, extra=()) -> subprocess.CompletedProcess:
    """`frugality train` in one process, or in `nproc` ranks as torchrun starts them, each
    forked from a process that has imported torch and frugality (tests/forked_cli.py)."""
    args = [
        "train",
        str(recipe_file),
        "--run-dir",
        str(run_dir),
        "--no-progress",
        *(a for o in overrides for a in ("--set", o)),
        *extra,
    ]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    if nproc > 1:
        done = forked_cli.ranks(nproc, *args, env=env, timeout=600)
    else:
        done = forked_cli.run(*args, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def losses(run_dir, kind="train") -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == kind}


# A training script whose rank 1 dies in its third step, as on a lost node (argv: recipe, run dir).
KILLED = """
import os, sys
from frugality.config.recipe import load_recipe
from frugality.training import loop, trainer
real = loop.train_step
def step(state, batches, **kw):
    if state.step == 2 and state.world.rank == 1:
        os._exit(9)  # the process dies mid-run, as on a lost node
    return real(state, batches, **kw)
loop.train_step = step
trainer.train(load_recipe(sys.argv[1]), run_dir=sys.argv[2], progress=False, tensorboard=False)
"""


def assert_close(ours: dict, theirs: dict, rel: float) -> None:
    """Two runs' losses step by step, within `rel`."""
    import pytest

    assert sorted(ours) == sorted(theirs)
    for step in theirs:
        assert ours[step] == pytest.approx(theirs[step], rel=rel), step
