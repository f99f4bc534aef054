"""Training-state bytes per parameter (weights, gradients, optimizer moments) and peak
memory, measured once after the first step, when gradients and moments exist: published
as the step's "memory" record for the log, and as the summary's `memory` section."""

from __future__ import annotations

from typing import TYPE_CHECKING

from frugality.metrics.memory import peak_memory_bytes, training_state_bytes
from frugality.training.callbacks import Callback

if TYPE_CHECKING:
    from frugality.runtime.state import TrainState
    from frugality.training.loop import RunEnd, StepResult


class Memory(Callback):
    def __init__(self) -> None:
        self.record: dict[str, float | None] = {}  # (peak memory: None where the device does not say)

    def on_step_end(self, state: TrainState, result: StepResult) -> None:
        if self.record:
            return
        n = sum(p.numel() for p in state.model.parameters())
        bytes_ = training_state_bytes(state.model, state.optimizer)
        self.record = {
            "training_state_bytes": bytes_,
            "bytes_per_param": bytes_ / n,
            "policy_bytes_per_param": state.policy.state_bytes_per_param,
            "peak_memory_bytes": peak_memory_bytes(state.device),
        }
        result.logs["memory"] = dict(self.record)

    def on_train_end(self, state: TrainState, end: RunEnd) -> None:
        end.summary["memory"] = self.record | {"peak_memory_bytes": peak_memory_bytes(state.device)}
