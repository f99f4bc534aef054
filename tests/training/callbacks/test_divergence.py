"""The bad-step policies at the callback: skips marked, rollback or stop when due. Rollbacks
of a real run: tests/training/test_nonfinite.py."""

import pytest

from frugality.errors import FrugalityWarning, RunDiverged
from frugality.training.callbacks.divergence import DivergenceGuard


def _with(state, **train):
    state.recipe = state.recipe.model_copy(update={"train": state.recipe.train.model_copy(update=train)})


def test_skipped_steps_are_marked_and_too_many_in_a_row_roll_back_or_stop(state, step):
    guard = DivergenceGuard()  # train.on_nonfinite = "skip", max_skipped = 3; no checkpoint
    guard.on_step_end(state, step(state))
    for _ in range(2):
        with pytest.warns(FrugalityWarning, match="the loss \\(nan\\) is not finite; its update was skipped"):
            result = step(state, loss=float("nan"), rejected="the loss (nan) is not finite")
            guard.on_step_end(state, result)
        assert result.record["skipped"] == "the loss (nan) is not finite"
    guard.on_step_end(state, step(state))  # a good step resets the count
    for _ in range(2):
        with pytest.warns(FrugalityWarning):
            guard.on_step_end(state, step(state, rejected="the gradient of w is not finite"))
    with pytest.raises(
        RunDiverged,
        match="step 7: the gradient of w is not finite, 3 steps in a row; stopping: no checkpoint to roll back to yet",
    ):
        guard.on_step_end(state, step(state, rejected="the gradient of w is not finite"))
    assert guard.skipped == [2, 3, 5, 6, 7]


def test_no_rollbacks_left_stops(state, step):
    _with(state, on_nonfinite="rollback", max_rollbacks=0)
    with pytest.raises(RunDiverged, match="step 1: the loss 9 is 5x its median; stopping after 0 rollback"):
        DivergenceGuard().on_step_end(state, step(state, loss=9.0, rejected="the loss 9 is 5x its median"))


def test_stop_policy_stops_at_the_first(state, step):
    _with(state, on_nonfinite="stop")
    with pytest.raises(RunDiverged, match="step 1: the loss \\(inf\\) is not finite; stopping before applying it"):
        DivergenceGuard().on_step_end(state, step(state, loss=float("inf"), rejected="the loss (inf) is not finite"))


def test_on_xla_a_bad_step_was_applied_so_it_rolls_back_and_stop_says_so(state, step):
    import torch

    state.device = torch.device("xla")  # every update applied; bad steps are seen at the steps read
    with pytest.raises(
        RunDiverged,
        match="step 1: the loss \\(nan\\) is not finite \\(XLA: already applied\\); stopping: no checkpoint to roll",
    ):
        DivergenceGuard().on_step_end(state, step(state, loss=float("nan"), rejected="the loss (nan) is not finite"))
    _with(state, on_nonfinite="stop")
    with pytest.raises(RunDiverged, match="is not finite; applied \\(XLA\\); stopping"):
        DivergenceGuard().on_step_end(state, step(state, loss=float("nan"), rejected="the loss (nan) is not finite"))
