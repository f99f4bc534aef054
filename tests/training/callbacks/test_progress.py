from frugality.training.callbacks.progress import Progress
from frugality.training.loop import RunEnd, StepResult


def test_the_whole_header_is_printed_with_progress_or_without(state, step, capsys):
    header = ["hardware: a CPU", "precision auto -> fp32", "the run"]
    quiet = Progress(header, enabled=False, stop_at=10)
    quiet.on_train_start(state)
    quiet.on_step_end(state, step(state))
    quiet.on_exit(state)
    assert capsys.readouterr().out.splitlines() == header  # a log without a bar names the run too
    loud = Progress(header, enabled=True, stop_at=10)
    loud.on_train_start(state)
    state.stop_requested = True
    loud.on_train_end(state, RunEnd())
    out = capsys.readouterr().out
    assert "the run" in out and f"stopped by signal after step {state.step}" in out


def test_the_progress_bar_shows_the_loss_of_the_step_it_counts(state):
    progress = Progress([], True, 10)
    progress.on_train_start(state)
    for number, loss in ((1, 5.5), (2, 4.25)):
        progress.on_step_end(state, StepResult(number, loss, 1.0, 1e-3, 0.1, False))
        shown = str(progress.bar)
        assert f"{number}/10" in shown and f"loss={loss:.3f}" in shown, shown
    progress.on_exit(state)
