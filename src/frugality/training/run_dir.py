"""The run directory `runs/<name>/`: resolved recipe, metrics, TensorBoard events,
checkpoints and the end-of-run summary. Deciding between resuming and starting over
happens here, before any file is touched."""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import time
import tomllib
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from frugality import distributed
from frugality.checkpoint import CheckpointManager
from frugality.config.recipe import Recipe
from frugality.errors import FrugalityWarning, UserError

RECIPE_FILE = "recipe.toml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
# Sections that must match for a checkpoint to be resumed under a recipe; the rest
# (steps, intervals, device...) may change between sessions of one run.
_MUST_MATCH = ("seed", "model", "data")


@dataclass(frozen=True)
class RunPlan:
    path: Path
    resume_from: Path | None  # a complete checkpoint, or None to start fresh
    moved_aside: Path | None  # where an earlier run's files went on --fresh


@contextmanager
def locked(run_dir: Path, world: distributed.World, device):
    """Hold the run directory for this run: an advisory lock (`flock`) on `.<name>.lock`
    beside it, holding the host, PID and start time, taken before anything in the directory
    is read or moved and kept to the end. A second run of the same directory stops with
    one line naming the holder. The kernel releases the lock of a process that dies, so a
    crashed run never blocks the next. Under torchrun rank 0 locks and every rank learns
    whether it could. On network filesystems where `flock` is not shared between hosts,
    two hosts are not kept apart."""
    held, problem = None, None
    if world.is_main:
        try:
            held = _acquire(run_dir)
        except UserError as e:
            problem = e
    if world.distributed and distributed.all_sum([0.0 if problem else 1.0], device)[0] < 1:
        problem = problem or UserError(f"run directory {run_dir} is in use by another run (rank 0 could not lock it)")
    if problem:
        raise problem
    try:
        yield
    finally:
        if held is not None:
            held.truncate(0)  # an empty lock file: released, nobody to take over from
            held.close()  # closing releases the flock


def lock_path(run_dir: Path) -> Path:
    return run_dir.with_name(f".{run_dir.name}.lock")


def _acquire(run_dir: Path):
    path = lock_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = _holder(f.read())
        f.close()
        raise UserError(f"run directory {run_dir} is in use by {holder} (lock {path}); wait for it to end, "
                        "or train into another --run-dir") from None
    f.seek(0)
    previous = f.read()
    if previous.strip():  # the last holder died without releasing: its lock went with it
        warnings.warn(f"run directory {run_dir}: taking over from {_holder(previous)}, which ended without "
                      "releasing it", FrugalityWarning, stacklevel=3)
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                        "started": datetime.datetime.now().isoformat(timespec="seconds")}))
    f.flush()
    return f


def _holder(text: str) -> str:
    try:
        info = json.loads(text)
        return f"PID {info['pid']} on {info['host']} (started {info['started']})"
    except (ValueError, KeyError, TypeError):
        return "another run"


def plan_run(recipe: Recipe, run_dir: Path, fresh: bool) -> RunPlan:
    """Decide what to do with `run_dir` without changing anything yet."""
    checkpoints = CheckpointManager(run_dir / "checkpoints")
    latest = checkpoints.latest()
    if latest is not None and not fresh:
        _check_compatible(recipe, run_dir)
        return RunPlan(run_dir, latest, None)
    has_files = run_dir.is_dir() and any(run_dir.iterdir())
    aside = None
    if has_files:  # starting over never deletes: the old run moves to a dated sibling
        aside = run_dir.with_name(f"{run_dir.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}")
    return RunPlan(run_dir, None, aside)


def open_run(plan: RunPlan, recipe: Recipe, resume_step: int | None) -> None:
    """Create or tidy the run directory once the plan is final."""
    if plan.moved_aside is not None:
        plan.path.rename(plan.moved_aside)
    plan.path.mkdir(parents=True, exist_ok=True)
    (plan.path / RECIPE_FILE).write_text(recipe.to_toml())
    if resume_step is not None:
        _truncate_metrics(plan.path / METRICS_FILE, resume_step)


def write_summary(run_dir: Path, summary: dict) -> None:
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")


def _check_compatible(recipe: Recipe, run_dir: Path) -> None:
    saved_path = run_dir / RECIPE_FILE
    try:
        saved = tomllib.loads(saved_path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"run directory {run_dir}: cannot read {RECIPE_FILE} to resume ({e})") from None
    now = tomllib.loads(recipe.to_toml())
    for section in _MUST_MATCH:
        if saved.get(section) != now.get(section):
            key = _first_difference(saved.get(section), now.get(section), section)
            raise UserError(
                f"run directory {run_dir} was trained with a different {key}; resume with the "
                "same recipe, or start over with --fresh (the old run is kept aside)"
            )


def _first_difference(a, b, prefix: str) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{prefix}.{k}")
    return f"{prefix} ({a!r} then, {b!r} now)"


def _record_step(line: str, dropped: int) -> int:
    """The step of a metrics record; `dropped` for a blank line or one cut by a crash or a
    full disk (not JSON)."""
    try:
        return json.loads(line).get("step", 0) if line.strip() else dropped
    except ValueError:
        return dropped


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records past the checkpoint we resume from: those steps will be run again."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True) if _record_step(line, step + 1) <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def active_runs(root: Path) -> list[dict]:
    """The runs training now under `root` (a runs folder, or one run directory): those
    whose lock names a live process of this host, with their step, speed and ETA from
    the log's last train record."""
    found = []
    for lock in sorted({*root.glob(".*.lock"), *root.parent.glob(f".{root.name}.lock")}):
        try:
            info = json.loads(lock.read_text() or "null")
        except (OSError, ValueError):
            continue
        if not isinstance(info, dict) or info.get("host") != socket.gethostname() or not _alive(info.get("pid")):
            continue
        run_dir = lock.with_name(lock.name[1:].removesuffix(".lock"))
        found.append({"run_dir": str(run_dir), "pid": info["pid"], "started": info.get("started"),
                      **_progress(run_dir)})
    return found


def _alive(pid) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _progress(run_dir: Path) -> dict:
    """Step, total steps, tokens/s and ETA from the log's last train record."""
    last = None
    try:
        with open(run_dir / METRICS_FILE, "rb") as f:  # the log's tail: it grows for the whole run
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            for line in f.read().decode("utf-8", "replace").splitlines():
                if '"kind": "train"' in line:
                    last = line
        total = tomllib.loads((run_dir / RECIPE_FILE).read_text()).get("train", {}).get("steps")
    except (OSError, ValueError):
        return {"step": None, "total_steps": None, "tokens_per_s": None, "eta_s": None}
    try:
        record = json.loads(last) if last else {}
    except ValueError:  # a line being written
        record = {}
    step, seconds = record.get("step"), record.get("step_time_s")
    eta = (total - step) * seconds if isinstance(total, int) and step is not None and seconds else None
    return {"step": step, "total_steps": total, "tokens_per_s": record.get("tokens_per_s"),
            "eta_s": None if eta is None else round(eta, 1)}
