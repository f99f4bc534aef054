"""The hang policy (`train.step_timeout_s`): a watchdog thread per rank, re-armed after every
step and evaluation from the end of the first step on (which includes compilation). When a
step, an evaluation or a checkpoint between them takes longer — a rank stuck in a
collective, a dead file system, a kernel that never returns — it writes every thread's
Python stack to `hang-rank<R>.txt` in the run directory and ends the process with
`HANG_EXIT` (5), which `--retries` reruns. Where a hang holds the GIL, faulthandler's own
timer writes the stacks at twice the limit and exits with status 1."""

from __future__ import annotations

import faulthandler
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from frugality.training.callbacks import Callback

if TYPE_CHECKING:
    from frugality.runtime.state import TrainState
    from frugality.training.loop import EvalResult, StepResult

HANG_EXIT = 5


class Watchdog(Callback):
    def __init__(self, run_dir: Path, timeout_s: float) -> None:
        self.path = run_dir / "hang-rank{rank}.txt"
        self.timeout_s = timeout_s
        self._deadline = threading.Event()  # set: re-armed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._file: TextIO | None = None

    def on_step_end(self, state: TrainState, result: StepResult) -> None:
        self._arm(state)

    def on_eval(self, state: TrainState, result: EvalResult) -> None:
        if self._thread is not None:
            self._arm(state)

    def on_exit(self, state: TrainState) -> None:
        self._stop.set()
        self._deadline.set()
        if self._file is not None:
            faulthandler.cancel_dump_traceback_later()
            self._file.close()
            self._file = None

    def _arm(self, state: TrainState) -> None:
        if self._thread is None:
            self._file = open(str(self.path).format(rank=state.world.rank), "w")  # noqa: SIM115 - closed by on_exit
            self._thread = threading.Thread(
                target=self._watch, args=(self._file,), name="frugality-watchdog", daemon=True
            )
            self._thread.start()
        assert self._file is not None  # opened with the thread; on_exit, which closes it, comes last
        faulthandler.dump_traceback_later(2 * self.timeout_s, exit=True, file=self._file)
        self._deadline.set()

    def _watch(self, file: TextIO) -> None:
        while not self._stop.is_set():
            self._deadline.clear()
            if not self._deadline.wait(self.timeout_s) and not self._stop.is_set():
                file.write(f"no step ended in {self.timeout_s:g} s (train.step_timeout_s); every thread:\n")
                file.flush()
                faulthandler.dump_traceback(file=file, all_threads=True)
                file.flush()
                os._exit(HANG_EXIT)
