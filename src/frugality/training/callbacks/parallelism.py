"""What a tensor- or pipeline-parallel step spends besides computing, for the summary's
`parallel` section (and `bench scale`'s table):

- pipeline parallel: the bubble, the share of the schedule's time a stage is not computing
  (forwards, backwards, the loss, the gradients' data-parallel reduction), so idle or
  waiting for a neighbour's send; the median
  step's, per pipeline rank and their mean, beside the schedule's ideal one (which assumes
  equal stages: a lighter stage also waits for a heavier one);
- tensor parallel: the seconds a step's rank is blocked in collectives (DTensor's
  all-reduces and gathers, their waits), from the torch profiler over single steps (the
  session's 3rd, 5th and 7th, each from after the previous step's evaluation and
  checkpoint to its own end); the median, averaged over the ranks.

Measured with host clocks, so on CPUs only: a GPU's work is asynchronous to them.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from frugality.backends import backend
from frugality.distributed import all_sum
from frugality.training.callbacks import Callback

if TYPE_CHECKING:
    import torch

    from frugality.runtime.state import TrainState
    from frugality.training.loop import RunEnd, StepResult

PROFILED = (2, 4, 6)  # the session's steps profiled (after its first), each alone


class ParallelFigures(Callback):
    def __init__(self, state: TrainState) -> None:
        self.on_cpu = backend(state.device).on_host  # (the CPU profiler times the collectives)
        self.profiled = {state.step + k for k in PROFILED}  # counted from the session's start
        self.idle: list[float] = []  # per step, the pipeline schedule's share not computing
        self.blocked: list[float] = []  # per profiled step, seconds in collectives
        self._profiler = None

    def on_step_end(self, state: TrainState, result: StepResult) -> None:
        pipeline = state.pipeline
        if pipeline is not None and pipeline.last_step is not None and result.rolled_back_to is None:
            elapsed, computing = pipeline.last_step
            self.idle.append(max(0.0, 1 - computing / elapsed) if elapsed > 0 else 0.0)
        if self._profiler is not None:
            self._profiler.stop()
            if result.rolled_back_to is None:  # (a rollback's restore is not a step's communication)
                self.blocked.append(_collective_seconds(self._profiler))
            self._profiler = None

    def on_step_done(self, state: TrainState) -> None:
        # after the step's evaluation and checkpoint (this callback comes after checkpointing):
        # the next step, alone, is profiled
        if not (self.on_cpu and state.world.tensor > 1 and state.step + 1 in self.profiled):
            return
        if state.stop_requested:
            return
        import os

        from torch.profiler import ProfilerActivity, profile

        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no profiler start and stop lines on stderr
        self._profiler = profile(activities=[ProfilerActivity.CPU])
        self._profiler.start()

    def on_train_end(self, state: TrainState, end: RunEnd) -> None:
        world = state.world
        if world.pipeline == 1 and world.tensor == 1:
            return
        # every rank's figures summed (each rank contributes where it measured); one collective
        idle = statistics.median(self.idle) if self.idle else 0.0
        blocked = statistics.median(self.blocked) if self.blocked else 0.0
        # per pipeline rank (its slot; the others zero): idle share and how many ranks measured it
        stages = [0.0] * (2 * world.pipeline)
        if self.idle and state.pipeline is not None:  # (idle time is measured under a pipeline only)
            at = state.pipeline.rank
            stages[2 * at : 2 * at + 2] = [idle, 1.0]
        mine = [blocked, float(bool(self.blocked)), *stages]
        blocked_sum, blocked_ranks, *stages = all_sum(mine, state.device) if world.distributed else mine
        section: dict = {"tensor": world.tensor, "pipeline": world.pipeline, "data": world.data_size}
        if state.pipeline is not None:
            p = state.pipeline
            per_stage = [round(s / n, 4) if n else None for s, n in zip(stages[::2], stages[1::2], strict=True)]
            measured = [s for s in per_stage if s is not None]
            section |= {
                "schedule": p.schedule,
                "micro_batches": p.micro_batches,
                "bubble": round(sum(measured) / len(measured), 4) if measured else None,
                "bubble_by_rank": per_stage,  # unequal stages: the lighter ones wait for the heavier
                "ideal_bubble": round(p.ideal_bubble(), 4),
            }
        if world.tensor > 1:
            section["tensor_collectives_s"] = round(blocked_sum / blocked_ranks, 5) if blocked_ranks else None
        end.summary["parallel"] = section

    def on_exit(self, state: TrainState) -> None:
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None


def _collective_seconds(profiler: torch.profiler.profile) -> float:
    """The main thread's own time in DTensor's collectives (the functional collectives
    tensor parallel issues, and their waits: `_c10d_functional::wait_tensor` holds the time
    blocked on a peer). Other collectives (data parallel's, the pipeline's sends) record
    only their issuing, so they are left out."""
    total_us = sum(e.self_cpu_time_total for e in profiler.key_averages() if e.key.startswith("_c10d_functional"))
    return total_us / 1e6
