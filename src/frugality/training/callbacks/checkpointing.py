"""Checkpoints on the recipe's cadence, at the last step of the session and when a stop is
asked: model, optimizer, data position and RNG states (`frugality.checkpoint`)."""

from __future__ import annotations

from frugality.training import rng
from frugality.training.callbacks import Callback


class Checkpointing(Callback):
    def __init__(self, manager, stop_at: int) -> None:
        self.manager, self.stop_at = manager, stop_at

    def on_step_done(self, state) -> None:
        if state.step % state.recipe.train.save_interval == 0 or state.step == self.stop_at or state.stop_requested:
            extra = {"data": state.data.stream.state_dict(), "rng": rng.get_state(), "step": state.step,
                     "precision": state.policy.name}  # a resume under another policy is refused
            self.manager.save(state.step, state.model, state.optimizer, extra)
