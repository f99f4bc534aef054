from frugality.training.callbacks.checkpointing import Checkpointing


class _Manager:
    def __init__(self):
        self.saved = []

    def save(self, step, model, optimizer, extra, asynchronous=False):
        self.saved.append((step, sorted(extra)))

    def poll(self):
        pass


def test_saves_on_the_cadence_at_the_session_end_and_when_asked_to_stop(state):
    manager = _Manager()
    cb = Checkpointing(manager, stop_at=6)
    for step in range(1, 7):  # save_interval 4; the session stops at 6
        state.step = step
        state.stop_requested = step == 2
        cb.on_step_done(state)
    assert [s for s, _ in manager.saved] == [2, 4, 6]
    assert manager.saved[0][1] == ["data", "precision", "recent_losses", "recipe", "rng", "step", "tokens_seen"]
