"""Checkpoints on the recipe's cadence, at the last step of the session and when a stop is
asked: model, optimizer, and the training state (`frugality.checkpoint`). With
`train.async_checkpoint` the cadence's saves are written in the background while training
goes on; the last one is written before the session ends."""

from __future__ import annotations

from typing import TYPE_CHECKING

from frugality.training.callbacks import Callback
from frugality.training.restore import training_state

if TYPE_CHECKING:
    from frugality.runtime.state import TrainState
    from frugality.training.loop import RunEnd


class Checkpointing(Callback):
    def __init__(self, manager, stop_at: int) -> None:
        self.manager, self.stop_at = manager, stop_at

    def on_step_done(self, state: TrainState) -> None:
        self.manager.poll()  # completes an asynchronous save whose files are written
        if state.step % state.recipe.train.save_interval == 0 or state.step == self.stop_at or state.stop_requested:
            last = state.step == self.stop_at or state.stop_requested  # nothing left to overlap with
            self.manager.save(
                state.step,
                state.model,
                state.optimizer,
                training_state(state),
                asynchronous=state.recipe.train.async_checkpoint and not last,
            )

    def on_train_end(self, state: TrainState, end: RunEnd) -> None:
        self.manager.wait()

    def on_exit(self, state: TrainState) -> None:
        self.manager.abandon()  # after an error: no collectives, the partial folder goes next time
