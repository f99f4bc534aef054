"""`frugality train --retries K`: a supervisor that reruns a crashed run from its latest
valid checkpoint.

The run itself is a child process: the same `frugality train` command (with `--nproc`,
torchrun's launcher inside it), so that a crash of any kind — an exception, a killed
rank, a kill -9, a hang that the collective timeout ends — leaves the supervisor standing.
After a failed attempt it waits (doubling back-off) and reruns the command, which resumes
from the newest checkpoint that verifies. It does not retry what a rerun cannot fix: bad
input (exit 2), a diverged run (exit 3) or an interruption (130, SIGTERM/Ctrl-C). It gives
up when K retries are spent or when two attempts in a row end without a new checkpoint,
with exit status 4.

Every attempt is a line of `attempts.jsonl` in the run directory (start, end, exit status
and cause, checkpoint step before and after, the last step logged, steps recomputed), and
the run's `summary.json` gains `attempts` and `goodput`: the time of the steps the final
run kept over the wall time of all attempts and back-offs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from frugality.checkpoint import CheckpointManager, step_of
from frugality.errors import DIVERGED_EXIT
from frugality.paths import write_atomically

GAVE_UP_EXIT = 4
ATTEMPTS_FILE = "attempts.jsonl"
NOT_RETRIED = {0: "finished", 2: "bad input or a filesystem fault", DIVERGED_EXIT: "diverged", 130: "interrupted"}


@dataclass
class Attempt:
    attempt: int
    started: float  # unix time
    ended: float
    exit_status: int
    cause: str
    checkpoint_before: int  # step of the newest complete checkpoint (0: none)
    checkpoint_after: int
    last_logged_step: int
    recomputed_steps: int  # logged by this attempt past its last checkpoint: redone by the next


def supervise(command: list[str], run_dir: Path, retries: int, backoff_s: float, log=None) -> int:
    """Run `command` (a `frugality train` without --retries) until it finishes or the
    supervisor gives up; the exit status of the last attempt, or GAVE_UP_EXIT."""
    log = log or (lambda line, **_: print(line, file=sys.stderr))
    attempts: list[Attempt] = []
    waited = 0.0
    no_progress = 0
    while True:
        before = _checkpoint_step(run_dir)
        started = time.time()
        status = subprocess.run(command if not attempts else _rerun(command, run_dir)).returncode
        ended = time.time()
        after, logged = _checkpoint_step(run_dir), _last_logged_step(run_dir)
        cause = NOT_RETRIED.get(status) or (
            f"killed by signal {-status}"
            if status < 0
            else f"a rank killed by signal {status - 128}"
            if 128 < status < 160
            else f"exit status {status}"
        )
        attempt = Attempt(
            len(attempts) + 1,
            started,
            ended,
            status,
            cause,
            before,
            after,
            logged,
            max(0, logged - after) if status not in NOT_RETRIED else 0,
        )
        attempts.append(attempt)
        _write(run_dir, attempts)
        if status in NOT_RETRIED:
            if status == 0:
                _summarise(run_dir, attempts, waited)
            return status
        no_progress = no_progress + 1 if after <= before else 0
        if len(attempts) > retries or no_progress >= 2:
            why = f"{retries} retries spent" if len(attempts) > retries else "two attempts in a row saved no checkpoint"
            log(
                f"error: {run_dir}: attempt {attempt.attempt} ended ({cause}); giving up: {why} "
                f"(see {run_dir / ATTEMPTS_FILE})",
                err=True,
            )
            return GAVE_UP_EXIT
        pause = backoff_s * 2 ** (len(attempts) - 1)
        log(
            f"warning: {run_dir}: attempt {attempt.attempt} ended ({cause}) at step {logged}; resuming from "
            f"step {after} in {pause:.0f} s (retry {len(attempts)} of {retries})",
            err=True,
        )
        time.sleep(pause)
        waited += pause


def _rerun(command: list[str], run_dir: Path) -> list[str]:
    """A rerun resumes (--fresh would move the progress aside); an attempt that saved no
    checkpoint left nothing to resume, and its files go aside (--fresh) for a new start."""
    resumed = [a for a in command if a != "--fresh"]
    return resumed if CheckpointManager(run_dir / "checkpoints").complete() else [*resumed, "--fresh"]


def _checkpoint_step(run_dir: Path) -> int:
    """The newest complete checkpoint's step, for progress (not hashed here: the rerun
    verifies it, and reading a large checkpoint twice per attempt would cost minutes)."""
    done = CheckpointManager(run_dir / "checkpoints").complete()
    return step_of(done[-1]) if done else 0


def _last_logged_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(line).get("step", 0) for line in lines if line.strip()]
    return max(steps, default=0)


def _write(run_dir: Path, attempts: list[Attempt]) -> None:
    """All attempts so far, written whole: a rerun without a checkpoint starts over and moves
    the run's files (this one included) aside."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(run_dir / ATTEMPTS_FILE, "".join(json.dumps(asdict(a)) + "\n" for a in attempts))


def _summarise(run_dir: Path, attempts: list[Attempt], waited: float) -> None:
    """Goodput into summary.json: the kept steps' time (this session's steps at its median
    step time) over the wall time of every attempt and back-off."""
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    wall = sum(a.ended - a.started for a in attempts) + waited
    steps = summary.get("final_step", 0) - attempts[0].checkpoint_before
    productive = steps * (summary.get("median_step_time_s") or 0.0)
    summary["attempts"] = len(attempts)
    summary["goodput"] = {
        "productive_s": round(productive, 3),
        "wall_s": round(wall, 3),
        "goodput": round(productive / wall, 4) if wall > 0 else None,
        "recomputed_steps": sum(a.recomputed_steps for a in attempts),
        "backoff_s": round(waited, 3),
    }
    write_atomically(path, json.dumps(summary, indent=2) + "\n")
