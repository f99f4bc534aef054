"""Callbacks: what happens around the training loop (`frugality.training.loop`) without
being part of it. Each concern is one module with one class; the trainer chooses them and
their order, and the loop calls every hook of each, in that order.

Hooks (all optional): on_train_start(state), on_compiled(state, phase),
on_step_end(state, result), on_eval(state, result), on_step_done(state),
on_train_end(state, end), on_exit(state) (always, also after an error).

Callbacks never hold or call each other. What one measures for others it publishes on
what the hook passes: a step's `StepResult` (`record`, the log's fields; `logs`, other
records for the log by kind; `rolled_back_to`), an evaluation's `EvalResult.record`, and at
the end `RunEnd.summary` (sections of `summary.json`). A callback that reads what another
publishes comes after it in the trainer's list, which is written in one place, top to
bottom, in hook order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from frugality.runtime.state import TrainState
    from frugality.training.loop import EvalResult, RunEnd, StepResult

HOOKS = ("on_train_start", "on_compiled", "on_step_end", "on_eval", "on_step_done", "on_train_end", "on_exit")


class Callback:
    """A no-op at every hook; subclasses override the hooks they need."""

    def on_train_start(self, state: TrainState) -> None: ...
    def on_compiled(self, state: TrainState, phase: str) -> None: ...
    def on_step_end(self, state: TrainState, result: StepResult) -> None: ...
    def on_eval(self, state: TrainState, result: EvalResult) -> None: ...
    def on_step_done(self, state: TrainState) -> None: ...
    def on_train_end(self, state: TrainState, end: RunEnd) -> None: ...
    def on_exit(self, state: TrainState) -> None: ...


class Callbacks:
    """Callbacks called in order at each hook."""

    def __init__(self, *callbacks: Callback) -> None:
        self.callbacks = list(callbacks)

    def __getattr__(self, hook: str):
        if hook not in HOOKS:
            raise AttributeError(hook)
        return lambda *args: [getattr(cb, hook)(*args) for cb in self.callbacks] and None
