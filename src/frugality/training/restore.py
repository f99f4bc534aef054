"""Putting a checkpoint back into a live run: the one sequence that a resume
(`frugality.training.trainer`) and a rollback (`callbacks.divergence`) both use."""

from __future__ import annotations

from pathlib import Path

from frugality.checkpoint import CheckpointManager, step_of
from frugality.runtime.optim import apply_fused_choice, fused_update
from frugality.runtime.state import TrainState
from frugality.training import rng


def training_state(state: TrainState) -> dict:
    """What a checkpoint holds besides model and optimizer, as plain JSON: data position,
    RNG states, the losses spike detection looks back on, the loss scale (amp-fp16), the precision policy (a resume
    under another policy is refused) and the recipe trained with (a resume must match its
    seed, model and data)."""
    assert state.data is not None  # a training run's state has its data
    scaler = getattr(state, "loss_scaler", None)
    return {
        "data": state.data.stream.state_dict(),
        "rng": rng.get_state(),
        "step": state.step,
        "precision": state.policy.name,
        "recent_losses": list(state.recent_losses),
        "tokens_seen": state.tokens_seen,
        **({"loss_scale": scaler.state_dict()} if scaler else {}),
        "recipe": state.recipe.model_dump(mode="json", exclude_none=True),
    }


def load_weights_and_moments(state: TrainState, checkpoints: CheckpointManager, path: Path) -> dict:
    """Model and optimizer from checkpoint `path` (torch keeps the saved groups'
    fused/foreach flags: the recipe's choice is applied again); its training state."""
    extra = checkpoints.load(path, state.model, state.optimizer)
    apply_fused_choice(state.optimizer, fused_update(state.recipe, state.device))
    return extra


def restore(state: TrainState, checkpoints: CheckpointManager, path: Path) -> dict:
    """Load checkpoint `path` into `state`: model and optimizer, the data position, RNG
    states, recent losses, tokens seen and the loss scale; `state.step` becomes its step. Returns its
    training state."""
    extra = load_weights_and_moments(state, checkpoints, path)
    assert state.data is not None  # a training run's state has its data
    state.data.stream.load_state_dict(extra["data"])
    rng.set_state(extra["rng"])
    state.recent_losses.clear()
    state.recent_losses.extend(extra.get("recent_losses", []))
    # Checkpoints older than the count are all of packed sequences (contrastive training
    # came with it): seq_len tokens each.
    d = state.recipe.data
    state.tokens_seen = int(extra.get("tokens_seen", extra.get("step", 0) * d.global_batch_size * d.seq_len))
    scaler = getattr(state, "loss_scaler", None)
    if scaler is not None and "loss_scale" in extra:
        scaler.load_state_dict(extra["loss_scale"])
    state.step = step_of(path)
    return extra
