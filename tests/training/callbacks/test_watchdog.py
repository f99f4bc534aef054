"""A rank stuck for good: both ranks of a 2-process run write their stacks and exit with
status 5 once a step takes longer than train.step_timeout_s."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HANGS = """
import sys, threading
from frugality.config.recipe import load_recipe
from frugality.training import loop, trainer
real = loop.train_step
def step(state, batches, **kw):
    if state.step == 2 and state.world.rank == 1:
        threading.Event().wait()  # stuck: rank 0 waits in the step's all-reduce for good
    return real(state, batches, **kw)
loop.train_step = step
trainer.train(load_recipe(sys.argv[1], ["train.step_timeout_s=4"]), run_dir=sys.argv[2], progress=False,
              tensorboard=False)
"""


@pytest.mark.distributed
def test_a_rank_stuck_in_a_step_ends_both_with_their_stacks(micro_recipe_file, tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    run = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(script),
            str(micro_recipe_file),
            str(run),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert done.returncode != 0 and "exitcode  : 5" in done.stderr
    stuck = (run / "hang-rank1.txt").read_text()
    assert stuck.startswith("no step ended in 4 s (train.step_timeout_s); every thread:")
    assert 'hangs.py", line 8 in step' in stuck  # where rank 1 is stuck
    waiting = (run / "hang-rank0.txt").read_text()  # rank 0: in backward, where DDP waits for its all-reduce
    assert "in backward" in waiting and 'hangs.py", line 8' not in waiting
