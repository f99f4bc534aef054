"""`frugality train` as a user meets it (issue #33): reruns that change nothing, resumed
runs summarised whole, hand edits that are kept, process counts that the machine and the
batch allow, and the end of a run by Ctrl-C, a full disk or memory: one line each."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import forked_cli
import fulldisk
import pytest


def frugality(*args, cwd=None, timeout=300, **kw) -> subprocess.CompletedProcess:
    return forked_cli.run(*args, cwd=cwd, timeout=timeout, **kw)


def _strict(path: Path) -> dict:
    """JSON as a strict reader takes it: NaN and Infinity are not JSON."""

    def refuse(name):
        raise AssertionError(f"{path} holds {name}")

    return json.loads(path.read_text(), parse_constant=refuse)


def _error(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.slow
def test_rerunning_a_finished_run_changes_nothing_and_a_resumed_summary_covers_the_whole_run(
    micro_recipe_file, tmp_path
):
    run = tmp_path / "run"
    first = frugality("train", micro_recipe_file, "--run-dir", run, "--no-progress", "--until-step", 4)
    assert first.returncode == 0, first.stderr
    part = _strict(run / "summary.json")
    second = frugality("train", micro_recipe_file, "--run-dir", run, "--no-progress")
    assert second.returncode == 0, second.stderr
    whole = _strict(run / "summary.json")
    assert (whole["start_step"], whole["final_step"], whole["sessions"]) == (4, 8, 2)
    assert whole["wall_time_s"] > part["wall_time_s"] and whole["train_time_s"] > part["train_time_s"]
    assert whole["median_tokens_per_s"] > 0 and whole["median_step_time_s"] > 0
    assert set(whole["val_losses"]) == {"0", "4", "8"}

    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for extra in ([], ["--init-from", run]):  # a finished run, asked again, with or without other weights
        again = frugality("train", micro_recipe_file, "--run-dir", run, "--no-progress", *extra)
        assert again.returncode == 0, again.stderr
        assert f"{run}: complete at step 8; nothing to do" in again.stdout
        assert f"{run}: step 8/8" in again.stdout  # the run's own closing line, from its summary
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert not (tmp_path / ".run.lock").exists()  # the lock goes with the run that held it


def test_hand_edits_of_the_run_recipe_are_kept_and_honoured_from_the_file(micro_recipe_file, tmp_path):
    run = tmp_path / "run"
    (tmp_path / "elsewhere").mkdir()
    assert frugality("train", micro_recipe_file, "--run-dir", run, "--no-progress", "--until-step", 2).returncode == 0
    saved = run / "recipe.toml"
    assert saved.read_text().startswith("# frugality-sha256: ")
    saved.write_text(saved.read_text().replace("lr = 0.01\n", "lr = 0.02\n"))
    # another recipe given: its values run, the edited file is kept and named
    other = frugality("train", micro_recipe_file, "--run-dir", run, "--no-progress", "--until-step", 4)
    assert other.returncode == 0, other.stderr
    assert f"{saved} was edited by hand (optim.lr 0.02 -> 0.01, as 'file -> this run')" in other.stdout
    assert "lr = 0.02\n" in (run / "recipe.edited.toml").read_text() and "lr = 0.01\n" in saved.read_text()
    # the hint followed as printed, from elsewhere: the edited file trains this run, with its values
    hint = other.stdout.split("to train with the edits, run: ", 1)[1].split("\n", 1)[0]
    assert hint == f"frugality train {run / 'recipe.edited.toml'}"
    edited = frugality(*shlex.split(hint)[1:], "--no-progress", "--until-step", 6, cwd=tmp_path / "elsewhere")
    assert edited.returncode == 0, edited.stderr
    assert "recipe changed since step_00000004: optim.lr 0.01 -> 0.02" in edited.stdout and f"-> {run}" in edited.stdout
    assert "was edited by hand" not in edited.stdout and "lr = 0.02\n" in saved.read_text()
    # a model changed in the file: "then" is what the checkpoint was trained with
    saved.write_text(saved.read_text().replace("num_layers = 2", "num_layers = 3"))
    changed = frugality("train", saved, "--run-dir", run, "--no-progress")
    assert changed.returncode == 2
    assert "was trained with another model.num_layers (2 in its checkpoint step_00000006, 3 now)" in _error(changed)
    # steps behind the run: named as train.steps, not as a --until-step never given
    behind = frugality(
        "train",
        micro_recipe_file,
        "--run-dir",
        run,
        "--no-progress",
        "--set",
        "train.steps=5",
        "--set",
        "optim.warmup_steps=1",
    )
    assert behind.returncode == 2
    assert f"train.steps (5): {run} is already at step 6; raise train.steps" in _error(behind)


@pytest.mark.distributed
def test_nproc_keeps_the_global_batch_and_refuses_what_cannot_run_once(micro_recipe_file, tmp_path):
    run = tmp_path / "run"
    done = frugality(
        "train",
        micro_recipe_file,
        "--run-dir",
        run,
        "--nproc",
        2,
        "--set",
        "data.micro_batch_size=4",
        "--set",
        "train.steps=2",
        "--set",
        "optim.warmup_steps=1",
    )
    assert done.returncode == 0, done.stderr
    assert "data.micro_batch_size 4 -> 2: the global batch of 4 over 2 ranks is 2 each" in done.stdout
    assert "OMP_NUM_THREADS" not in done.stderr  # torchrun's banner: the threads are set for it
    threads = max(1, len(os.sched_getaffinity(0)) // 2)  # each rank's share, said as a rank's
    assert f"{threads} thread{'s' * (threads != 1)} in this process;" in done.stdout
    assert _strict(run / "summary.json")["final_step"] == 2
    odd = frugality(
        "train",
        micro_recipe_file,
        "--run-dir",
        tmp_path / "odd",
        "--nproc",
        2,
        "--set",
        "data.global_batch_size=3",
        "--set",
        "data.micro_batch_size=1",
    )
    assert odd.returncode == 2
    assert "data.global_batch_size (3) cannot be shared evenly by 2 data-parallel ranks" in _error(odd)
    cores = len(os.sched_getaffinity(0))
    many = frugality("train", micro_recipe_file, "--run-dir", tmp_path / "many", "--nproc", cores + 1)
    assert many.returncode == 2
    assert f"--nproc {cores + 1}: this machine has {cores} CPU cores" in _error(many)
    assert not (tmp_path / "odd").exists() and not (tmp_path / "many").exists()


def _wait_for(predicate, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _steps_logged(run: Path) -> int:
    try:
        return sum('"kind": "train"' in line for line in (run / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


@contextmanager
def _long_run(micro_recipe_file, run: Path, *extra):
    """A run far longer than the test, in a process group of its own, its output in files
    (a pipe nobody reads would fill and block it); whatever is left of it killed at the end."""
    out, err = run.with_suffix(".out"), run.with_suffix(".err")
    with open(out, "w") as o, open(err, "w") as e:
        job = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "frugality",
                "train",
                str(micro_recipe_file),
                "--run-dir",
                str(run),
                "--no-progress",
                "--set",
                "train.steps=100000",
                "--set",
                "train.save_interval=100000",
                "--set",
                "train.eval_interval=100000",
                *extra,
            ],
            stdout=o,
            stderr=e,
            text=True,
            start_new_session=True,
        )
    job.out, job.err = out, err
    try:
        yield job
    finally:
        with suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()


@pytest.mark.distributed
def test_ctrl_c_under_nproc_saves_and_exits_130_without_a_traceback(micro_recipe_file, tmp_path):
    run = tmp_path / "run"
    with _long_run(micro_recipe_file, run, "--nproc", "2") as job:
        _wait_for(lambda: _steps_logged(run) >= 2, "two steps")
        os.killpg(job.pid, signal.SIGINT)  # the terminal's Ctrl-C: every process of the group
        job.wait(timeout=300)
        out, err = job.out.read_text(), job.err.read_text()
    assert job.returncode == 130, err
    assert "Traceback" not in err and "SignalException" not in err, err
    assert "checkpoint saved, rerun to resume" in out
    assert list((run / "checkpoints").glob("step_*"))


AT_A_TERMINAL = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def test_ctrl_c_while_starting_exits_130_without_a_traceback(tmp_path):
    job = subprocess.Popen(
        # as at a terminal, SIGINT at its default (a suite started in the background by a
        # script, `pytest &`, passes its children SIGINT ignored: Python then never raises
        # KeyboardInterrupt), then the command in the same process
        [sys.executable, "-c", AT_A_TERMINAL, "-m", "frugality", "train", "--run-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # while torch is being imported: the window in which a Ctrl-C used to end in a traceback
    maps = Path(f"/proc/{job.pid}/maps")
    _wait_for(lambda: job.poll() is None and "libtorch" in maps.read_text(), "torch being imported", timeout=60)
    job.send_signal(signal.SIGINT)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "interrupted"


@pytest.mark.distributed
def test_ranks_end_with_a_launcher_that_is_killed(micro_recipe_file, tmp_path):
    import psutil

    run = tmp_path / "run"
    with _long_run(micro_recipe_file, run, "--nproc", "2") as job:
        _wait_for(lambda: _steps_logged(run) >= 1, "a step")
        ranks = [p for p in psutil.Process(job.pid).children(recursive=True) if "frugality" in " ".join(p.cmdline())]
        assert len(ranks) == 2
        job.kill()  # as the OOM killer would: no chance to stop the ranks itself
        job.wait(timeout=60)
        _, alive = psutil.wait_procs(ranks, timeout=60)
        assert not alive, f"ranks left behind: {[p.pid for p in alive]}"


def test_memory_a_batch_cannot_have_is_one_line_before_anything_is_written(micro_recipe_file, tmp_path):
    huge = frugality(
        "train",
        micro_recipe_file,
        "--run-dir",
        tmp_path / "run",
        "--set",
        "data.micro_batch_size=65536",
        "--set",
        "data.global_batch_size=65536",
    )
    assert huge.returncode == 2
    line = _error(huge)
    assert line.startswith("error: data.micro_batch_size 65536 x seq_len 32 needs about ") and "GiB free" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_full_disk_at_the_first_checkpoint_is_one_line(micro_recipe_file, tmp_path):
    disk = tmp_path / "disk"
    result = fulldisk.run_on_small_disk(
        disk,
        256 * 1024,
        ["train", str(micro_recipe_file), "--run-dir", str(disk / "run"), "--no-progress"],
        cwd=tmp_path,
    )
    _, left = fulldisk.left(result)
    assert result.returncode == 2, result.stderr
    line = _error(result)
    assert (
        line.startswith(
            f"error: cannot write checkpoint {disk / 'run' / 'checkpoints' / 'step_00000004'}: No space left on device"
        )
        and "free on the device holding" in line
    )
    assert not [p for p in left if ".partial" in p], left  # no half-written checkpoint


def test_the_run_header_and_a_contrastive_runs_metrics_are_printed_without_progress(micro_pairs_recipe, tmp_path):
    done = frugality(
        "train",
        micro_pairs_recipe,
        "--run-dir",
        tmp_path / "run",
        "--no-progress",
        "--set",
        "train.steps=2",
        "--set",
        "optim.warmup_steps=1",
    )
    assert done.returncode == 0, done.stderr
    assert "micro-pairs: bert" in done.stdout  # the header's run line
    closing = done.stdout.strip().splitlines()[-2]  # before the cost line
    assert "recall@1 " in closing and "recall@10 " in closing and "mrr " in closing


@pytest.mark.slow
def test_a_published_recipe_runs_on_the_bundled_corpus(tmp_path):
    """pythia-14m as shipped (2048-token samples: a validation split of a few samples, fewer
    than its eval_samples and than one of its micro-batches), on a laptop-sized batch."""
    run = tmp_path / "run"
    done = frugality(
        "train",
        "pythia-14m",
        "--run-dir",
        run,
        "--no-progress",
        "--until-step",
        1,
        "--set",
        "data.global_batch_size=2",
        "--set",
        "data.micro_batch_size=1",
        "--set",
        "compile.level=O0",
    )
    assert done.returncode == 0, done.stderr
    summary = _strict(run / "summary.json")
    assert summary["final_step"] == 1 and summary["first_val_loss"] > 10  # the whole split, evaluated at step 0


def test_a_run_shorter_than_its_warmup_trains_with_the_warmup_cut_and_says_so(
    frugality_cli, micro_recipe_file, tmp_path
):
    """`--set train.steps=N` alone, below the recipe's warm-up (the micro recipe's 2): the run
    trains, and its header says what the warm-up became."""
    done = frugality_cli(
        "train", micro_recipe_file, "--run-dir", tmp_path / "run", "--no-progress", "--set", "train.steps=1"
    )
    assert done.returncode == 0, done.stderr
    assert "optim.warmup_steps 2 -> 1: the warm-up is cut to train.steps" in done.stdout
    assert "warmup_steps = 2" in (tmp_path / "run" / "recipe.toml").read_text()  # the recipe as asked
