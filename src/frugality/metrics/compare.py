"""Step-by-step comparison of two runs' trajectories (loss and gradient norm), e.g. the
same recipe under two precision policies, devices or world sizes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from frugality.errors import UserError


@dataclass
class Trajectory:
    train: dict[int, dict]  # step -> train record
    eval: dict[int, dict]  # step -> eval record


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
        return max((abs(a - b) for a, b in zip(self.loss_a, self.loss_b)), default=0.0)

    @property
    def mean_rel_grad_norm_diff(self) -> float:
        pairs = [(a, b) for a, b in zip(self.grad_norm_a, self.grad_norm_b) if a]
        return sum(abs(b - a) / a for a, b in pairs) / len(pairs) if pairs else 0.0

    @property
    def final_val_rel_diff(self) -> float:
        """(b - a) / a for the last evaluation both runs have."""
        if not self.eval_steps:
            raise UserError("the two runs share no evaluation step")
        return (self.val_loss_b[-1] - self.val_loss_a[-1]) / self.val_loss_a[-1]


def load_trajectory(run_dir: str | Path) -> Trajectory:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"run {run_dir}: no metrics.jsonl")
    train, evals = {}, {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            train[record["step"]] = record
        elif record["kind"] == "eval":
            evals[record["step"]] = record
    return Trajectory(train, evals)


def compare_runs(run_a: str | Path, run_b: str | Path) -> Comparison:
    a, b = load_trajectory(run_a), load_trajectory(run_b)
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
