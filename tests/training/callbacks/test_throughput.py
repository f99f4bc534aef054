from frugality.training.callbacks.throughput import Throughput


def test_tokens_per_second_and_mfu_are_recorded_and_never_above_100_percent(state, step):
    t = Throughput()
    t.on_train_start(state)
    assert t.peak == 1e9 and t.flops_per_token > 0
    result = step(state, seconds=0.5)
    t.on_step_end(state, result)
    assert result.record["tokens_per_s"] == 128 and result.record["tokens"] == 64
    assert result.record["step_time_s"] == 0.5
    assert result.record["mfu"] == t.flops_per_token * 128 / 1e9
    fast = step(state, seconds=1e-9)  # an impossible rate against this peak
    t.on_step_end(state, fast)
    assert fast.record["mfu"] is None
