"""SIGINT and SIGTERM (Ctrl-C, SLURM preemption) ask the run to stop after the current step,
with a checkpoint; a second signal stops at once."""

from __future__ import annotations

import signal

from frugality.training.callbacks import Callback


class StopOnSignal(Callback):
    def __init__(self) -> None:
        self.previous: dict = {}
        self.state = None

    def _handle(self, signum, frame) -> None:
        if self.state.stop_requested:  # a second signal: stop now
            raise KeyboardInterrupt
        self.state.stop_requested = True

    def on_train_start(self, state) -> None:
        self.state = state
        try:
            self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not the main thread: leave signals alone
            self.previous = {}

    def on_train_end(self, state) -> None:
        self.on_exit(state)

    def on_exit(self, state) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}
