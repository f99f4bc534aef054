"""What a step with non-finite values does (`train.on_nonfinite`). The loop never applies
such a step; this callback logs it, with the step and what was not finite first, and
stops the run — at once (`stop`), or after `train.max_skipped` skipped steps in a row
(`skip`) — with `RunDiverged` (exit status 3; the last checkpoint stays the one to resume
from)."""

from __future__ import annotations

import warnings

from frugality.errors import FrugalityWarning, RunDiverged
from frugality.training.callbacks import Callback


class NanGuard(Callback):
    def __init__(self) -> None:
        self.in_a_row = 0
        self.skipped: list[int] = []  # steps whose update was skipped, for the summary

    def on_step_end(self, state, result) -> None:
        if result.nonfinite is None:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.skipped.append(result.step)
        result.record["skipped"] = result.nonfinite
        train = state.recipe.train
        what = f"step {result.step}: {result.nonfinite} is not finite"
        if train.on_nonfinite == "stop":
            raise RunDiverged(f"{what}; stopping before applying it (train.on_nonfinite = \"stop\")")
        if self.in_a_row >= train.max_skipped:
            raise RunDiverged(f"{what}, {self.in_a_row} steps in a row; stopping (train.max_skipped = "
                              f"{train.max_skipped}; lower optim.lr or resume from the last checkpoint)")
        if state.world.is_main:
            warnings.warn(f"{what}; its update was skipped ({self.in_a_row} in a row, stopping at "
                          f"{train.max_skipped})", FrugalityWarning, stacklevel=2)
