from frugality.training.callbacks.memory import Memory


class _Log:
    def __init__(self):
        self.records = []
        self.logger = self

    def log(self, kind, step, values):
        self.records.append((kind, step, values))


def test_measured_once_after_the_first_step(state, step):
    log = _Log()
    memory = Memory(log)
    memory.on_step_end(state, step(state))
    memory.on_step_end(state, step(state))
    assert [(k, s) for k, s, _ in log.records] == [("memory", 1)]
    record = memory.record
    assert record["training_state_bytes"] > 0 and record["policy_bytes_per_param"] == 16
    assert record["bytes_per_param"] == record["training_state_bytes"] / 20  # Linear(4, 4): 20 parameters
