"""What a bad step does (`train.on_nonfinite`): one whose loss or gradients are not finite,
or whose loss spikes (`train.loss_spike`). The loop never applies such a step; this callback
logs it, with the step and what was wrong first, then:

- `skip`: goes on; after `train.max_skipped` bad steps in a row, rolls back;
- `rollback`: rolls back at once;
- `stop`: stops at once.

A rollback restores the last checkpoint (model, optimizer, RNG states, data position) and
serves the rest of the epoch in a new order, so the run does not meet the same batches
again; past `train.max_rollbacks` rollbacks (counted in the data stream's state, so a
resumed run counts them too) the run stops with `RunDiverged` (exit status 3; the last
checkpoint stays the one to resume from, with a lower learning rate). Every rank decides
alike: the loss is the ranks' mean and the norm global.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from frugality.backends import backend
from frugality.checkpoint import CheckpointManager
from frugality.errors import FrugalityWarning, RunDiverged
from frugality.training.callbacks import Callback
from frugality.training.restore import restore

if TYPE_CHECKING:
    from frugality.runtime.state import TrainState
    from frugality.training.loop import StepResult


class DivergenceGuard(Callback):
    def __init__(self, checkpoints: CheckpointManager | None = None) -> None:
        self.checkpoints = checkpoints  # a CheckpointManager (None: no rollback possible)
        self.in_a_row = 0
        self.skipped: list[int] = []  # steps whose update was skipped, for the summary
        self.rollbacks = 0

    def _stop(self, message: str) -> None:
        """Stop the run; an asynchronous save in flight is completed first (every rank takes
        this decision alike, so the collectives that takes are safe)."""
        if self.checkpoints is not None:
            self.checkpoints.wait()
        raise RunDiverged(message)

    def on_step_end(self, state: TrainState, result: StepResult) -> None:
        if result.overflow is not None:  # amp-fp16's loss scale overflowed: neither a bad step nor a good one
            return
        if result.rejected is None:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.skipped.append(result.step)
        result.record["skipped"] = result.rejected
        train = state.recipe.train
        what = f"step {result.step}: {result.rejected}"
        applied = backend(state.device).traced  # XLA applies every update; a bad one is undone by rolling back
        if train.on_nonfinite == "stop":
            done = "applied (XLA); stopping" if applied else "stopping before applying it"
            self._stop(f'{what}; {done} (train.on_nonfinite = "stop")')
        if train.on_nonfinite == "rollback" or self.in_a_row >= train.max_skipped or applied:
            if applied:
                what += " (XLA: already applied)"
            elif train.on_nonfinite == "skip":
                what += f", {self.in_a_row} steps in a row"
            result.rolled_back_to = result.record["rolled_back_to"] = self._roll_back(state, what)
            return
        if state.world.is_main:
            warnings.warn(
                f"{what}; its update was skipped ({self.in_a_row} in a row, rolling back at {train.max_skipped})",
                FrugalityWarning,
                stacklevel=2,
            )

    def _roll_back(self, state: TrainState, what: str) -> int:
        train = state.recipe.train
        assert state.data is not None  # (a training run's state has its data)
        # Rollbacks so far: this session's, or those the restored checkpoints recorded (a
        # restore rewinds the data stream's record, never this count)
        done = max(self.rollbacks, len(state.data.stream.reshuffles))
        if done >= train.max_rollbacks:
            self._stop(
                f"{what}; stopping after {done} rollback(s) (train.max_rollbacks = "
                f"{train.max_rollbacks}; lower optim.lr and resume from the last checkpoint)"
            )
        checkpoints = self.checkpoints
        if checkpoints is not None:
            checkpoints.wait()  # an asynchronous save in flight is the newest checkpoint
        path = checkpoints.latest() if checkpoints is not None else None
        if checkpoints is None or path is None:
            raise RunDiverged(f"{what}; stopping: no checkpoint to roll back to yet")
        restore(state, checkpoints, path)
        self.rollbacks = done + 1
        state.data.stream.reshuffle(self.rollbacks)  # from the restored position: other batches each time
        self.in_a_row = 0
        if state.world.is_main:
            warnings.warn(
                f"{what}; rolled back to {path.name}, the rest of the epoch reshuffled "
                f"(rollback {done + 1} of {train.max_rollbacks})",
                FrugalityWarning,
                stacklevel=3,
            )
        return state.step
