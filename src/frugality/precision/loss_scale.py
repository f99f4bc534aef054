"""Dynamic loss scaling for `amp-fp16`: fp16's range ends at 65504 and its smallest normal
number is 6e-5, so small gradients underflow to zero unless the loss is multiplied by a
large scale before backward (and the gradients divided by it before the update).

torch's `GradScaler` keeps the scale; the training loop makes the decision, from the step's
global gradient norm, so that every rank decides alike (as it does for bad steps):

- gradients not finite, loss finite, scale above 1: an *overflow*. The scale was too large;
  the step is skipped (not applied, not a bad step), the scale halves, training goes on.
  Megatron-LM, DeepSpeed and `GradScaler` itself do the same.
- gradients not finite at a scale of 1 or less, or the loss not finite: the model's own
  values overflow, whatever the scale: a bad step (`train.on_nonfinite`).
- `train.loss_scale_window` steps in a row without an overflow double the scale. A bad
  step (or a loss spike) is neither: it leaves the scale and the count of clean steps as
  they were.

The scale and its counters are part of the checkpoint, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import math

import torch


class LossScaler:
    def __init__(self, device: torch.device, init_scale: float, window: int) -> None:
        self.scaler = torch.amp.GradScaler(device.type, init_scale=init_scale, growth_interval=window)
        self.window = window  # the recipe's, also after a resume (a checkpoint holds the one it ran with)
        self.overflows = 0  # steps skipped for an overflow, over the whole run (checkpointed)
        self.overflowed = False  # whether the last step was one
        self.scale_before = init_scale  # the last step's scale

    @property
    def scale(self) -> float:
        return float(self.scaler.get_scale())

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale in place, before their norm is taken."""
        self.scale_before = self.scale
        self.scaler.unscale_(optimizer)

    def is_overflow(self, loss: float, norm: float) -> bool:
        """Whether a step whose gradients are not finite is the scale's fault (see the module)."""
        return math.isfinite(loss) and not math.isfinite(norm) and self.scale_before > 1.0

    def update(self, overflow: bool, applied: bool) -> None:
        """After every step: the scale halves after an overflow and grows after a window of
        applied steps; a step rejected for another reason (a bad step, a spike) changes
        neither. An overflow is judged from the global norm; the scaler is told the same, so
        its own per-rank check cannot disagree."""
        self.overflowed = overflow
        self.overflows += overflow
        if not overflow and not applied:  # the scale and the count of clean steps stay as they were
            self.scaler.update(new_scale=self.scale)
            return
        state = self.scaler._per_optimizer_states
        for per_optimizer in state.values():  # the scaler's record of what unscale_ found
            for found in per_optimizer["found_inf_per_device"].values():
                found.fill_(1.0 if overflow else 0.0)
        self.scaler.update()

    def describe_overflow(self) -> str:
        return f"gradients overflowed fp16 at loss scale {self.scale_before:g}: step skipped, scale now {self.scale:g}"

    def state_dict(self) -> dict:
        return {**self.scaler.state_dict(), "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        self.overflows = int(state.pop("overflows", 0))
        self.scaler.load_state_dict(state)
        self.scaler.set_growth_interval(self.window)
        self.scale_before = self.scale
