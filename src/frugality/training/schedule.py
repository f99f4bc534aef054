"""Learning-rate schedule: linear warm-up, then cosine decay to a floor (GPT-NeoX/Pythia).

A pure function of the step, so resuming needs nothing but the step count.
"""

from __future__ import annotations

import math


def learning_rate(step: int, total_steps: int, lr: float, min_lr: float, warmup_steps: int) -> float:
    """Learning rate for the update that completes step `step + 1` (steps count from 0). A
    warm-up longer than the run is cut to it (the run header says so)."""
    warmup_steps = min(warmup_steps, total_steps)
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
