from frugality.training.callbacks.progress import Progress


def test_the_header_is_printed_and_the_run_line_only_with_progress(state, step, capsys):
    header = ["hardware: a CPU", "precision auto -> fp32", "the run"]
    quiet = Progress(header, enabled=False, stop_at=10)
    quiet.on_train_start(state)
    quiet.on_step_end(state, step(state))
    quiet.on_exit(state)
    assert capsys.readouterr().out.splitlines() == header[:2]
    loud = Progress(header, enabled=True, stop_at=10)
    loud.on_train_start(state)
    state.stop_requested = True
    loud.on_train_end(state)
    out = capsys.readouterr().out
    assert "the run" in out and f"stopped by signal after step {state.step}" in out
