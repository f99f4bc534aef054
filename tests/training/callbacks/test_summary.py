import json

from frugality.training.callbacks.summary import Summary
from frugality.training.callbacks.throughput import Throughput
from frugality.training.loop import EvalResult, RunEnd


def test_the_summary_has_the_whole_runs_validation_losses(state, step, tmp_path):
    # an earlier session of the run logged step 0's evaluation
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 0, "loss": 9.0}) + "\n")
    state.step, state.tokens_seen = 4, 4 * 64  # as restored from the checkpoint of step 4
    throughput = Throughput()
    summary = Summary(tmp_path)  # reads only what the others publish
    for cb in (throughput, summary):
        cb.on_train_start(state)
    for _ in range(2):
        result = step(state)
        throughput.on_step_end(state, result)
        summary.on_step_end(state, result)
    summary.on_eval(state, EvalResult(state.step, 5.0))
    end = RunEnd({"memory": {"bytes_per_param": 16.0}})
    throughput.on_train_end(state, end)
    summary.on_train_end(state, end)
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written == summary.summary
    assert written["start_step"] == 4 and written["final_step"] == 6 and written["tokens_seen"] == 6 * 64
    assert written["val_losses"] == {"0": 9.0, "6": 5.0}
    assert written["first_val_loss"] == 9.0 and written["final_val_loss"] == 5.0
    assert written["median_tokens_per_s"] == 128.0 and written["memory"]["bytes_per_param"] == 16.0
    assert written["peak_flops"] == throughput.peak
    assert written["compile"] == {"graphs": 2, "level": "O1"} and written["precision"] == "fp32"
