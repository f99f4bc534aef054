import os
import signal

import pytest

from frugality.training.callbacks.signals import StopOnSignal


def test_sigterm_asks_for_a_stop_a_second_one_stops_now_and_handlers_are_restored(state):
    before = signal.getsignal(signal.SIGTERM)
    cb = StopOnSignal()
    cb.on_train_start(state)
    os.kill(os.getpid(), signal.SIGTERM)
    assert not state.stop_requested  # the ranks agree at the step's end
    cb.on_step_end(state, None)
    assert state.stop_requested
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)
    cb.on_exit(state)
    assert signal.getsignal(signal.SIGTERM) is before
