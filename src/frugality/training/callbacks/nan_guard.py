"""What a non-finite training loss does: stop the run with an error naming the step (its
last checkpoint stays the one to resume from). The policy a later supervisor extends."""

from __future__ import annotations

import math

from frugality.training.callbacks import Callback


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or infinite."""


class NanGuard(Callback):
    def on_step_end(self, state, result) -> None:
        if not math.isfinite(result.loss):
            raise NonFiniteLoss(f"training loss became {result.loss} at step {result.step}; stopping")
