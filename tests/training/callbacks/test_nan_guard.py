import pytest

from frugality.errors import FrugalityWarning, RunDiverged
from frugality.training.callbacks.nan_guard import NanGuard


def test_skipped_steps_are_marked_and_too_many_in_a_row_stop_the_run(state, step):
    guard = NanGuard()  # train.on_nonfinite = "skip", max_skipped = 3
    guard.on_step_end(state, step(state))
    for _ in range(2):
        with pytest.warns(FrugalityWarning, match="the loss \\(nan\\) is not finite; its update was skipped"):
            result = step(state, loss=float("nan"), nonfinite="the loss (nan)")
            guard.on_step_end(state, result)
        assert result.record["skipped"] == "the loss (nan)"
    guard.on_step_end(state, step(state))  # a good step resets the count
    for _ in range(2):
        with pytest.warns(FrugalityWarning):
            guard.on_step_end(state, step(state, nonfinite="the gradient of w"))
    with pytest.raises(RunDiverged, match="step 7: the gradient of w is not finite, 3 steps in a row; stopping"):
        guard.on_step_end(state, step(state, nonfinite="the gradient of w"))
    assert guard.skipped == [2, 3, 5, 6, 7]


def test_stop_policy_stops_at_the_first(state, step):
    state.recipe = state.recipe.model_copy(update={"train": state.recipe.train.model_copy(
        update={"on_nonfinite": "stop"})})
    with pytest.raises(RunDiverged, match="step 1: the loss \\(inf\\) is not finite; stopping before applying it"):
        NanGuard().on_step_end(state, step(state, loss=float("inf"), nonfinite="the loss (inf)"))
