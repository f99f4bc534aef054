"""Checkpoints on the recipe's cadence, at the last step of the session and when a stop is
asked: model, optimizer, and the training state (`frugality.checkpoint`). With
`train.async_checkpoint` the cadence's saves are written in the background while training
goes on; the last one is written before the session ends."""

from __future__ import annotations

from frugality.training import rng
from frugality.training.callbacks import Callback


def training_state(state) -> dict:
    """What a checkpoint holds besides model and optimizer, as plain JSON: data position,
    RNG states, the losses spike detection looks back on, the precision policy (a resume
    under another policy is refused) and the recipe trained with (a resume must match its
    seed, model and data)."""
    return {"data": state.data.stream.state_dict(), "rng": rng.get_state(), "step": state.step,
            "precision": state.policy.name, "recent_losses": list(state.recent_losses),
            "tokens_seen": state.tokens_seen,
            "recipe": state.recipe.model_dump(mode="json", exclude_none=True)}  # what a resume must match


def restore_training_state(state, extra: dict) -> None:
    """Put `training_state`'s result back (older checkpoints lack the recent losses)."""
    state.data.stream.load_state_dict(extra["data"])
    rng.set_state(extra["rng"])
    state.recent_losses.clear()
    state.recent_losses.extend(extra.get("recent_losses", []))
    # Checkpoints older than the count are all of packed sequences (contrastive training
    # came with it): seq_len tokens each.
    d = state.recipe.data
    state.tokens_seen = int(extra.get("tokens_seen", extra.get("step", 0) * d.global_batch_size * d.seq_len))


class Checkpointing(Callback):
    def __init__(self, manager, stop_at: int) -> None:
        self.manager, self.stop_at = manager, stop_at

    def on_step_done(self, state) -> None:
        self.manager.poll()  # completes an asynchronous save whose files are written
        if state.step % state.recipe.train.save_interval == 0 or state.step == self.stop_at or state.stop_requested:
            last = state.step == self.stop_at or state.stop_requested  # nothing left to overlap with
            self.manager.save(state.step, state.model, state.optimizer, training_state(state),
                              asynchronous=state.recipe.train.async_checkpoint and not last)

    def on_train_end(self, state) -> None:
        self.manager.wait()

    def on_exit(self, state) -> None:
        self.manager.abandon()  # after an error: no collectives, the partial folder goes next time
