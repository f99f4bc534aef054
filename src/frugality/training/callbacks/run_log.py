"""The run's log: `metrics.jsonl` and TensorBoard events (`frugality.metrics.logger`): one
record per logged train step, per evaluation, and per compile report."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from frugality.metrics.logger import RunLogger
from frugality.training.callbacks import Callback

if TYPE_CHECKING:
    from frugality.runtime.state import TrainState
    from frugality.training.loop import EvalResult, RunEnd, StepResult


class RunLog(Callback):
    def __init__(self, run_dir, tensorboard: bool) -> None:
        self.logger = RunLogger(run_dir, tensorboard=tensorboard)

    def on_compiled(self, state: TrainState, phase: str) -> None:
        self.logger.log("compile", state.step if phase == "eval" else state.step + 1, compile_record(state))

    def on_step_end(self, state: TrainState, result: StepResult) -> None:
        for kind, values in result.logs.items():  # what other callbacks measured, by kind
            self.logger.log(kind, result.step, values)
        if result.step % state.recipe.train.log_interval == 0 or result.final:
            assert state.data is not None  # (a training run's state has its data)
            self.logger.log(
                "train",
                result.step,
                {
                    "loss": result.loss,
                    "grad_norm": result.grad_norm,
                    "lr": result.lr,
                    **result.record,
                    "epoch": state.data.stream.epoch,
                },
            )

    def on_eval(self, state: TrainState, result: EvalResult) -> None:
        loss = result.loss
        record = {"loss": loss}
        if state.task.perplexity:  # a language model's (masked LM: pseudo-) perplexity
            record["perplexity"] = math.exp(loss) if loss < 700 else math.inf
        self.logger.log("eval", state.step, {**record, **result.record})

    def on_train_end(self, state: TrainState, end: RunEnd) -> None:
        if state.compiled.enabled:
            self.logger.log("compile", state.step, compile_record(state))
        self.logger.close()  # flushed before the summary reads it back

    def on_exit(self, state: TrainState) -> None:
        self.logger.close()  # closing twice is harmless


def compile_record(state: TrainState) -> dict:
    return {k: v for k, v in state.compiled.stats.as_dict().items() if isinstance(v, (int, float))}


class CloseCompileSession(Callback):
    """At the end of training: publish what was compiled before the last compile record and
    the summary are written (the trainer closes it again, harmlessly, on every exit)."""

    def on_train_end(self, state: TrainState, end: RunEnd) -> None:
        state.compiled.close()
