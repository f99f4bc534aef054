"""The run's summary (`summary.json`): steps, tokens, time, median tokens/s and MFU, the
validation losses of the whole run (earlier sessions' too, read back from the log),
memory, compilation, and what the run cost (dollars, energy, carbon; `cost`)."""

from __future__ import annotations

import json
import time

from frugality.metrics.flops import non_embedding_params
from frugality.metrics.memory import peak_memory_bytes
from frugality.training import run_dir as rundir
from frugality.training.callbacks import Callback


class Summary(Callback):
    def __init__(self, run_dir, throughput, memory, cost=None) -> None:
        self.run_dir, self.throughput, self.memory, self.cost = run_dir, throughput, memory, cost
        self.start_step = 0
        self.evals: dict[int, float] = {}
        self.train_loss: float | None = None
        self.summary: dict = {}

    def on_train_start(self, state) -> None:
        self.start_step = state.step
        self.wall_start = time.perf_counter()

    def on_step_end(self, state, result) -> None:
        self.train_loss = result.loss

    def on_eval(self, state, result) -> None:
        self.evals[state.step] = result.loss

    def on_train_end(self, state) -> None:
        recipe, t = state.recipe, self.throughput
        evals = dict(self.evals)
        for line in (self.run_dir / rundir.METRICS_FILE).read_text().splitlines():
            record = json.loads(line)
            if record["kind"] == "eval":
                evals.setdefault(record["step"], record["loss"])
        median = t.median_step_time()
        mfu = t.median_mfu()
        self.summary = {
            "recipe": recipe.name,
            "device": str(state.device),
            "precision": state.policy.label,
            "precision_requested": recipe.train.precision,
            "parameters": sum(p.numel() for p in state.model.parameters()),
            "non_embedding_parameters": non_embedding_params(state.model),
            "start_step": self.start_step,
            "final_step": state.step,
            "total_steps": recipe.train.steps,
            "interrupted": state.stop_requested,
            "tokens_seen": state.tokens_seen,
            "wall_time_s": round(time.perf_counter() - self.wall_start, 2),
            "train_time_s": round(sum(t.step_times), 2),
            "median_step_time_s": round(median, 4) if median is not None else float("nan"),
            "median_tokens_per_s": round(t.median_tokens_per_s(), 1) if median is not None else None,
            "median_mfu": None if mfu is None else round(mfu, 4),
            "peak_flops": t.peak,
            "final_train_loss": self.train_loss,
            "first_val_loss": evals[min(evals)] if evals else None,
            "final_val_loss": evals[max(evals)] if evals else None,
            "val_losses": {str(k): v for k, v in sorted(evals.items())},
            "memory": self.memory.record | {"peak_memory_bytes": peak_memory_bytes(state.device)},
            "compile": state.compiled.stats.as_dict(),
        }
        if self.cost is not None:
            self.summary["cost"] = self.cost.figures(state.tokens_seen, recipe.cost.target_loss)
        rundir.write_summary(self.run_dir, self.summary)
