"""The run's summary (`summary.json`): steps, tokens, time, median tokens/s and MFU, the
validation losses of the whole run, memory, compilation, and what the run cost (dollars,
energy, carbon; `cost`).

A resumed run's summary covers every part of the run: the medians take the earlier
sessions' logged steps (read back from the log, which is cut at the checkpoint resumed
from) with this session's, and the times add the earlier sessions' summary to this one's
(a session that crashed wrote none: its time is not known)."""

from __future__ import annotations

import json
import math
import statistics
import time
from typing import TYPE_CHECKING

from frugality.metrics.flops import non_embedding_params
from frugality.training import run_dir as rundir
from frugality.training.callbacks import Callback

if TYPE_CHECKING:
    from pathlib import Path

    from frugality.runtime.state import TrainState
    from frugality.training.loop import EvalResult, RunEnd, StepResult


class Summary(Callback):
    """Reads what the callbacks before it publish: each step's record (tokens/s, MFU and
    step time from Throughput) and the end's sections (peak, memory, cost)."""

    def __init__(self, run_dir) -> None:
        self.run_dir = run_dir
        self.start_step = 0
        self.steps: list[dict] = []  # this session's step records
        self.train_time_s = 0.0
        self.evals: dict[int, float] = {}
        self.eval_metrics: dict[int, dict] = {}  # what an evaluation measured besides the loss
        self.train_loss: float | None = None
        self.summary: dict = {}

    def on_train_start(self, state: TrainState) -> None:
        self.start_step = state.step
        self.wall_start = time.perf_counter()

    def on_step_end(self, state: TrainState, result: StepResult) -> None:
        self.train_time_s += result.seconds
        if result.loss is not None:
            self.train_loss = result.loss
        if "step_time_s" in result.record:  # (XLA: steps measured together, at the steps read)
            self.steps.append({k: result.record.get(k) for k in ("step_time_s", "tokens_per_s", "mfu")})

    def on_eval(self, state: TrainState, result: EvalResult) -> None:
        self.evals[state.step] = result.loss
        self.eval_metrics[state.step] = _retrieval(result.record)

    def on_train_end(self, state: TrainState, end: RunEnd) -> None:
        recipe = state.recipe
        evals, metrics, earlier = dict(self.evals), dict(self.eval_metrics), []
        for record in _records(self.run_dir / rundir.METRICS_FILE):
            if record.get("kind") == "eval":
                evals.setdefault(record["step"], record["loss"])
                metrics.setdefault(record["step"], _retrieval(record))
            elif record.get("kind") == "train" and record.get("step", 0) <= self.start_step:
                earlier.append(record)  # an earlier session's logged steps (the log is cut at the resume)
        # every part of the run: this session's steps and the earlier sessions' logged ones
        parts = self.steps + earlier
        times, rates, mfus = (
            [r[key] for r in parts if _number(r.get(key))] for key in ("step_time_s", "tokens_per_s", "mfu")
        )
        previous = rundir.read_summary(self.run_dir) if self.start_step else {}
        if not previous or not 0 < previous.get("final_step", 0) <= self.start_step:
            previous = {}  # none, or not of an earlier part of this run
        self.summary = {
            "recipe": recipe.name,
            "device": str(state.device),
            "precision": state.policy.label,
            "precision_requested": recipe.train.precision,
            # this session's mode (auto may choose anew on a resume)
            "activation_checkpointing": getattr(state, "checkpointing", "none"),
            "parameters": _counts(state)[0],
            "non_embedding_parameters": _counts(state)[1],
            "start_step": self.start_step,
            "final_step": state.step,
            "total_steps": recipe.train.steps,
            "interrupted": state.stop_requested,
            "tokens_seen": state.tokens_seen,
            "sessions": previous.get("sessions", 1) + 1 if previous else 1,
            "wall_time_s": round(previous.get("wall_time_s", 0) + time.perf_counter() - self.wall_start, 2),
            "train_time_s": round(previous.get("train_time_s", 0) + self.train_time_s, 2),
            "median_step_time_s": _median(times, 4),
            "median_tokens_per_s": _median(rates, 1),
            "median_mfu": _median(mfus, 4),
            "peak_flops": end.summary.get("peak_flops"),
            "final_train_loss": self.train_loss,
            "first_val_loss": evals[min(evals)] if evals else None,
            "final_val_loss": evals[max(evals)] if evals else None,
            "val_losses": {str(k): v for k, v in sorted(evals.items())},
            "final_eval_metrics": metrics[max(metrics)] if metrics else {},
            "memory": end.summary.get("memory", {}),
            "compile": state.compiled.stats.as_dict(),
        }
        scaler = getattr(state, "loss_scaler", None)
        if scaler is not None:  # amp-fp16: over the whole run (the counts are checkpointed)
            self.summary["loss_scale"] = {"final": scaler.scale, "overflow_steps": scaler.overflows}
        for section in ("cost", "parallel"):
            if section in end.summary:
                self.summary[section] = end.summary[section]
        rundir.write_summary(self.run_dir, self.summary)


def _retrieval(record: dict) -> dict:
    """What an evaluation measured besides its loss: a contrastive run's recall@k, MRR and
    candidates (nothing for language models)."""
    return {k: v for k, v in record.items() if k.startswith("recall@") or k in ("mrr", "candidates")}


def _records(path: Path) -> list[dict]:
    """The log's records; a line cut by a crash or a full disk is skipped."""
    found = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            found.append(record)
    return found


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _median(values: list[float], digits: int) -> float | None:
    return round(statistics.median(values), digits) if values else None


def _counts(state: TrainState) -> tuple[int, int]:
    """The model's parameters and non-embedding parameters (under pipeline parallel, the
    whole model's, not this rank's stages')."""
    pipeline = getattr(state, "pipeline", None)
    if pipeline is not None:
        return pipeline.parameters, pipeline.non_embedding_parameters
    return sum(p.numel() for p in state.model.parameters()), non_embedding_params(state.model)
