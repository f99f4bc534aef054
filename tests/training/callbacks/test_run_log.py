import json
import math

from frugality.training.callbacks.run_log import CloseCompileSession, RunLog
from frugality.training.loop import EvalResult, RunEnd


def _records(tmp_path):
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_train_records_every_log_interval_and_at_the_last_step_evals_and_compile_reports(state, step, tmp_path):
    log = RunLog(tmp_path, tensorboard=False)
    log.on_compiled(state, "eval")  # step 0's evaluation compiled
    log.on_eval(state, EvalResult(state.step, 3.0))
    for i in range(4):
        result = step(state, final=i == 3)
        result.record["tokens_per_s"] = 100.0
        log.on_step_end(state, result)
    log.on_train_end(state, RunEnd())
    records = _records(tmp_path)
    assert [(r["kind"], r["step"]) for r in records] == [
        ("compile", 0),
        ("eval", 0),
        ("train", 3),
        ("train", 4),
        ("compile", 4),
    ]
    train = records[2]
    assert list(train) == ["kind", "step", "loss", "grad_norm", "lr", "tokens_per_s", "epoch"]
    assert records[1]["perplexity"] == math.exp(3.0)


def test_the_compile_session_is_closed_at_the_end(state):
    closed = []
    state.compiled.close = lambda: closed.append(1)
    CloseCompileSession().on_train_end(state, RunEnd())
    assert closed == [1]
