"""Tokens per second and model FLOPs utilisation per step, against the measured peak of the
dtype the products run in (`frugality.metrics.peak`), published in each step's record (the
log's, and the summary's medians); the peak, in the summary's section."""

from __future__ import annotations

from typing import TYPE_CHECKING

from frugality.backends import backend
from frugality.metrics.flops import training_flops_per_token
from frugality.metrics.peak import mfu, peak_flops
from frugality.training.callbacks import Callback

if TYPE_CHECKING:
    from frugality.runtime.state import TrainState
    from frugality.training.loop import RunEnd, StepResult


class Throughput(Callback):
    def __init__(self) -> None:
        self.peak: float | None = None
        self.flops_per_token = 0.0
        self._pending = (0, 0.0, 0)  # XLA: tokens, seconds and steps since the last step read

    def on_train_start(self, state: TrainState) -> None:
        r = state.recipe
        pipeline = getattr(state, "pipeline", None)  # a rank holds its stages: the whole model's count
        params = pipeline.non_embedding_parameters if pipeline is not None else None
        self.flops_per_token = training_flops_per_token(
            state.model, r.model.num_layers, r.model.hidden_size, r.data.seq_len, params
        )
        self.peak = (
            r.metrics.peak_tflops * 1e12
            if r.metrics.peak_tflops
            else peak_flops(state.device, state.policy.compute_dtype)
        )
        self.peak *= state.world.world_size * state.world.devices  # tokens/s are global: every device's peak

    def on_step_end(self, state: TrainState, result: StepResult) -> None:
        if backend(state.device).traced and result.loss is None:
            # XLA runs a step's graphs while the host traces the next: a step not read is only
            # its tracing; the time of the steps since the last read is measured at the next
            self._pending = (self._pending[0] + result.tokens, self._pending[1] + result.seconds, self._pending[2] + 1)
            return
        tokens, seconds, steps = (
            self._pending[0] + result.tokens,
            self._pending[1] + result.seconds,
            self._pending[2] + 1,
        )
        self._pending = (0, 0.0, 0)
        tokens_per_s = tokens / seconds
        result.record.update(
            tokens_per_s=tokens_per_s,
            mfu=mfu(self.flops_per_token * tokens_per_s, self.peak),
            step_time_s=seconds / steps,
            tokens=state.tokens_seen,
        )

    def on_train_end(self, state: TrainState, end: RunEnd) -> None:
        end.summary["peak_flops"] = self.peak
