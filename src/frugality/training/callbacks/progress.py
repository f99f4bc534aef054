"""What a person watching sees: the run header, a progress bar with loss and tokens/s,
compile reports, validation losses, and how the run stopped."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tqdm import tqdm

from frugality.training.callbacks import Callback

if TYPE_CHECKING:
    from frugality.runtime.state import TrainState
    from frugality.training.loop import EvalResult, RunEnd, StepResult


class Progress(Callback):
    def __init__(self, header: list[str], enabled: bool, stop_at: int) -> None:
        self.header, self.enabled, self.stop_at = header, enabled, stop_at
        self.bar: tqdm | None = None

    def on_train_start(self, state: TrainState) -> None:
        for line in self.header:  # with --no-progress too: a log (SLURM's) shows what ran
            tqdm.write(line)
        self.bar = tqdm(
            total=self.stop_at, initial=state.step, unit="step", disable=not self.enabled, dynamic_ncols=True
        )

    def on_compiled(self, state: TrainState, phase: str) -> None:
        if self.enabled:
            tqdm.write(compile_line(phase, state.compiled.stats))

    def on_step_end(self, state: TrainState, result: StepResult) -> None:
        assert self.bar is not None  # opened at on_train_start
        # the figures first, then the count that redraws the bar: the loss shown is the step's named
        if result.loss is not None:  # (XLA reads it at logging steps only)
            self.bar.set_postfix(
                loss=f"{result.loss:.3f}", tok_s=f"{result.record.get('tokens_per_s', 0):,.0f}", refresh=False
            )
        self.bar.update(1)

    def on_eval(self, state: TrainState, result: EvalResult) -> None:
        if self.bar is not None and state.step:
            self.bar.set_postfix(val=f"{result.loss:.3f}", refresh=False)

    def on_train_end(self, state: TrainState, end: RunEnd) -> None:
        self.on_exit(state)
        if state.stop_requested:  # the checkpoint was written at the step's end
            tqdm.write(f"stopped by signal after step {state.step}; checkpoint saved, rerun to resume")

    def on_exit(self, state: TrainState) -> None:
        if self.bar is not None:
            self.bar.close()


def compile_line(phase: str, stats) -> str:
    source = "cache entry fetched from" if stats.fetched else "no cache entry at"
    line = (
        f"compile {stats.level}, {phase} ready: {stats.graphs} graphs so far, {stats.cache_hits} "
        f"from the cache, {stats.cache_misses} compiled, {stats.compile_s:.1f} s ({source} "
        f"{stats.cache})"
    )
    if stats.fallbacks:
        line += f"; eager fallback for {', '.join(stats.fallbacks)}"
    return line
