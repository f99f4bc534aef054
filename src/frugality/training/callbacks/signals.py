"""SIGINT and SIGTERM (Ctrl-C, SLURM preemption) ask the run to stop after the current step,
with a checkpoint; a second signal stops at once.

With several ranks a signal may reach some of them only, or reach them during different
steps; the ranks agree at the end of each step (a one-number all-reduce) so that every rank
stops after the same step and saves the same checkpoint."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from frugality.distributed import all_sum
from frugality.training.callbacks import Callback

if TYPE_CHECKING:
    from types import FrameType

    from frugality.runtime.state import TrainState
    from frugality.training.loop import RunEnd, StepResult


class StopOnSignal(Callback):
    def __init__(self) -> None:
        self.previous: dict = {}
        self.asked = False  # a signal reached this rank

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.asked:  # a second signal: stop now
            raise KeyboardInterrupt
        self.asked = True

    def on_train_start(self, state: TrainState) -> None:
        try:
            self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not the main thread: leave signals alone
            self.previous = {}

    def on_step_end(self, state: TrainState, result: StepResult) -> None:
        asked = self.asked or state.stop_requested
        if state.world.distributed:
            asked = all_sum([float(asked)], state.device)[0] > 0
        state.stop_requested = asked

    def on_train_end(self, state: TrainState, end: RunEnd) -> None:
        self.on_exit(state)

    def on_exit(self, state: TrainState) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}
