"""Quality parity of two runs (the same recipe on two devices, precisions or world sizes):
the final validation loss decides, within a relative tolerance (0.1% by default: the bar a
production migration is held to); the step-aligned training loss and gradient-norm curves
show where the runs part, by their largest deviation and its step; cost and energy come
side by side from the two summaries."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from frugality.errors import UserError

DEFAULT_TOLERANCE = 0.001


@dataclass
class Trajectory:
    train: dict[int, dict]  # step -> train record
    eval: dict[int, dict]  # step -> eval record
    summary: dict = field(default_factory=dict)  # summary.json, where the run finished one


@dataclass
class Comparison:
    steps: list[int]  # train steps present in both runs
    loss_a: list[float]
    loss_b: list[float]
    grad_norm_a: list[float]
    grad_norm_b: list[float]
    eval_steps: list[int] = field(default_factory=list)
    val_loss_a: list[float] = field(default_factory=list)
    val_loss_b: list[float] = field(default_factory=list)

    @property
    def max_abs_loss_diff(self) -> float:
        return max((abs(a - b) for a, b in zip(self.loss_a, self.loss_b, strict=True)), default=0.0)

    @property
    def mean_rel_grad_norm_diff(self) -> float:
        pairs = [(a, b) for a, b in zip(self.grad_norm_a, self.grad_norm_b, strict=True) if a]
        return sum(abs(b - a) / a for a, b in pairs) / len(pairs) if pairs else 0.0

    @property
    def final_val_rel_diff(self) -> float:
        """(b - a) / a for the last evaluation both runs have."""
        if not self.eval_steps:
            raise UserError("the two runs share no evaluation step")
        return (self.val_loss_b[-1] - self.val_loss_a[-1]) / self.val_loss_a[-1]

    def largest(self, curve: str) -> tuple[float, int | None]:
        """The largest relative deviation |b - a| / |a| of a curve ('loss', 'grad_norm')
        and the step where it happens."""
        a, b = getattr(self, f"{curve}_a"), getattr(self, f"{curve}_b")
        best = (0.0, None)
        for step, x, y in zip(self.steps, a, b, strict=True):
            if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x:
                best = max(best, (abs(y - x) / abs(x), step), key=lambda t: t[0])
        return best


def load_trajectory(run_dir: str | Path) -> Trajectory:
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"run {run_dir}: no metrics.jsonl (not a run directory, or a run that never started)")
    train, evals = {}, {}
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue  # a last line cut by a crash
            raise UserError(f"{path} line {number}: not JSON") from None
        if record.get("kind") == "train":
            train[record["step"]] = record
        elif record.get("kind") == "eval":
            evals[record["step"]] = record
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}  # a run that never finished a session (or a damaged file): no figures from it
    return Trajectory(train, evals, summary if isinstance(summary, dict) else {})


def compare_runs(run_a: str | Path, run_b: str | Path) -> Comparison:
    a, b = load_trajectory(run_a), load_trajectory(run_b)
    return _compare(a, b)


def _compare(a: Trajectory, b: Trajectory) -> Comparison:
    steps = sorted(set(a.train) & set(b.train))
    eval_steps = sorted(set(a.eval) & set(b.eval))
    return Comparison(
        steps=steps,
        loss_a=[a.train[s]["loss"] for s in steps],
        loss_b=[b.train[s]["loss"] for s in steps],
        grad_norm_a=[a.train[s]["grad_norm"] for s in steps],
        grad_norm_b=[b.train[s]["grad_norm"] for s in steps],
        eval_steps=eval_steps,
        val_loss_a=[a.eval[s]["loss"] for s in eval_steps],
        val_loss_b=[b.eval[s]["loss"] for s in eval_steps],
    )


def parse_tolerance(text: str) -> float:
    """'0.1%' or '0.001' -> 0.001."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise UserError(f"--tolerance {text!r}: expected a fraction (0.001) or a percentage (0.1%)") from None
    if not 0 <= value < 1:
        raise UserError(f"--tolerance {text!r}: must lie in [0, 100%)")
    return value


def parity(run_a: str | Path, run_b: str | Path, tolerance: float = DEFAULT_TOLERANCE) -> dict:
    """The verdict and what it rests on, as JSON-ready numbers."""
    a, b = load_trajectory(run_a), load_trajectory(run_b)
    c = _compare(a, b)
    if not c.eval_steps:
        raise UserError(f"{run_a} and {run_b} share no evaluation step: nothing to judge quality by")
    if c.eval_steps[-1] != max(a.eval) or c.eval_steps[-1] != max(b.eval):
        raise UserError(
            f"the runs' last evaluations differ (steps {max(a.eval)} and {max(b.eval)}): "
            f"compare runs of the same length"
        )
    numbers = all(isinstance(v, (int, float)) and v == v for v in (c.val_loss_a[-1], c.val_loss_b[-1]))
    final = c.final_val_rel_diff if numbers else None  # a diverged run ("nan" in the log) fails
    loss_dev, loss_step = c.largest("loss")
    norm_dev, norm_step = c.largest("grad_norm")
    side = {}
    costs = [cost if isinstance(cost := t.summary.get("cost"), dict) else {} for t in (a, b)]
    for key in (
        "tokens",
        "wall_time_s",
        "tokens_per_s",
        "usd",
        "tokens_per_dollar",
        "kwh",
        "joules_per_token",
        "kg_co2e",
    ):
        side[key] = [c.get(key) for c in costs]
    labels = [{k: c.get("labels", {}).get(k) for k in ("price", "energy")} for c in costs]
    return {
        "verdict": "PASS" if final is not None and abs(final) <= tolerance else "FAIL",  # (None: not numbers)
        "tolerance": tolerance,
        "final_step": c.eval_steps[-1],
        "final_val_loss": [c.val_loss_a[-1], c.val_loss_b[-1]],
        "final_val_rel_diff": final,
        "train_steps_compared": len(c.steps),
        "train_loss_max_rel_dev": loss_dev,
        "train_loss_max_rel_dev_step": loss_step,
        "grad_norm_max_rel_dev": norm_dev,
        "grad_norm_max_rel_dev_step": norm_step,
        "cost": side,
        "cost_labels": labels,  # how each run's dollars and energy are known
    }
