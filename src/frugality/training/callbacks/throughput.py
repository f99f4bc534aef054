"""Tokens per second and model FLOPs utilisation per step, against the measured peak of the
dtype the products run in (`frugality.metrics.peak`); the step times for the summary."""

from __future__ import annotations

import statistics

from frugality.metrics.flops import training_flops_per_token
from frugality.metrics.peak import mfu, peak_flops
from frugality.training.callbacks import Callback


class Throughput(Callback):
    def __init__(self) -> None:
        self.step_times: list[float] = []
        self.step_tokens: list[int] = []
        self.peak: float | None = None
        self.flops_per_token = 0.0

    @property
    def tokens_per_step(self) -> float:
        """The mean over this session's steps: a constant for packed sequences; for
        contrastive training, the texts' real tokens on average."""
        return sum(self.step_tokens) / len(self.step_tokens) if self.step_tokens else 0

    def on_train_start(self, state) -> None:
        r = state.recipe
        self.flops_per_token = training_flops_per_token(
            state.model, r.model.num_layers, r.model.hidden_size, r.data.seq_len
        )
        self.peak = (
            r.metrics.peak_tflops * 1e12
            if r.metrics.peak_tflops
            else peak_flops(state.device, state.policy.compute_dtype)
        )
        self.peak *= state.world.world_size  # tokens/s are global: against every rank's device

    def on_step_end(self, state, result) -> None:
        self.step_times.append(result.seconds)
        self.step_tokens.append(result.tokens)
        tokens_per_s = result.tokens / result.seconds
        result.record.update(
            tokens_per_s=tokens_per_s,
            mfu=mfu(self.flops_per_token * tokens_per_s, self.peak),
            step_time_s=result.seconds,
            tokens=state.tokens_seen,
        )

    def tokens_per_s(self) -> list[float]:
        """Each step's tokens/s, this session."""
        return [n / t for n, t in zip(self.step_tokens, self.step_times)]

    def mfus(self) -> list[float]:
        found = (mfu(self.flops_per_token * rate, self.peak) for rate in self.tokens_per_s())
        return [m for m in found if m is not None]

    def on_train_end(self, state, end) -> None:
        end.summary["peak_flops"] = self.peak

    def median_step_time(self) -> float | None:
        return statistics.median(self.step_times) if self.step_times else None

    def median_tokens_per_s(self) -> float | None:
        """The median of the steps' tokens/s (with buckets, steps differ in tokens too)."""
        if not self.step_times:
            return None
        return statistics.median(n / t for n, t in zip(self.step_tokens, self.step_times))

    def median_mfu(self) -> float | None:
        rate = self.median_tokens_per_s()
        return None if rate is None else mfu(self.flops_per_token * rate, self.peak)
