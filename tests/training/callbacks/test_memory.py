from frugality.training.callbacks.memory import Memory
from frugality.training.loop import RunEnd


def test_measured_once_after_the_first_step_and_published(state, step):
    memory = Memory()
    first, second = step(state), step(state)
    memory.on_step_end(state, first)
    memory.on_step_end(state, second)
    assert list(first.logs) == ["memory"] and not second.logs  # for the log, once
    record = first.logs["memory"]
    assert record["training_state_bytes"] > 0 and record["policy_bytes_per_param"] == 16
    assert record["bytes_per_param"] == record["training_state_bytes"] / 20  # Linear(4, 4): 20 parameters
    end = RunEnd()
    memory.on_train_end(state, end)
    assert end.summary["memory"]["training_state_bytes"] == record["training_state_bytes"]
