import pytest

from frugality.training.callbacks.nan_guard import NanGuard, NonFiniteLoss


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_loss_stops_the_run_naming_the_step(state, step, loss):
    guard = NanGuard()
    guard.on_step_end(state, step(state, loss=2.0))
    with pytest.raises(NonFiniteLoss, match=f"training loss became {loss} at step 2"):
        guard.on_step_end(state, step(state, loss=loss))
