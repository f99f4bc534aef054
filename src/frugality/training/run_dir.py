"""The run directory `runs/<name>/`: resolved recipe, metrics, TensorBoard events,
checkpoints and the end-of-run summary. Deciding between resuming and starting over
happens here, before any file is touched."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import math
import os
import socket
import time
import tomllib
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from torch.distributed.checkpoint.api import CheckpointException

from frugality import distributed
from frugality.checkpoint import CheckpointManager, read_extra
from frugality.config.recipe import Recipe
from frugality.errors import FrugalityWarning, UserError
from frugality.paths import check_output_folder, write_atomically

if TYPE_CHECKING:
    import torch

RECIPE_FILE = "recipe.toml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
# Sections that must match for a checkpoint to be resumed under a recipe; the rest
# (steps, intervals, device...) may change between sessions of one run. The micro-batch is
# a per-device choice (the global batch is what is trained), so it may change too.
_MUST_MATCH = ("seed", "model", "data")
_MAY_CHANGE = ("data.micro_batch_size",)
# recipe.toml's first lines; the hash line tells a file edited by hand from the one written
_RECIPE_HEADER = """\
# The recipe this run last ran with, written by `frugality train` at each start. Edits take
# effect only when this file is the recipe given: `frugality train {path}` trains
# this run directory (seed, model and data must stay as trained). A run started from another
# recipe replaces this file and keeps an edited one beside it as recipe.edited.toml.
"""
_HASH_PREFIX = "# frugality-sha256: "


@dataclass(frozen=True)
class RunPlan:
    path: Path
    resume_from: Path | None  # a complete checkpoint, or None to start fresh
    moved_aside: Path | None  # where an earlier run's files went on --fresh
    changes: tuple[str, ...] = ()  # keys that may change, changed since the checkpoint: "optim.lr 0.001 -> 0.002"
    unused_edits: tuple[str, ...] = ()  # hand edits of recipe.toml that this run's recipe does not have
    edited_kept_as: Path | None = None  # where the hand-edited recipe.toml goes


@contextmanager
def locked(run_dir: Path, world: distributed.World, device: torch.device):
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
            _release(run_dir, held)


def lock_path(run_dir: Path) -> Path:
    return run_dir.with_name(f".{run_dir.name}.lock")


@contextlib.contextmanager
def held(run_dir: Path, hint: str):
    """`locked` for one process that is not a training run (a server): found by `frugality
    top` as runs are; `hint` says what to do when another process holds it."""
    f = _acquire(run_dir, hint)
    try:
        yield
    finally:
        _release(run_dir, f)


def _release(run_dir: Path, f: IO) -> None:
    """Removed while still held (a process that opened it meanwhile sees it gone and opens
    anew); closing releases the flock."""
    lock_path(run_dir).unlink(missing_ok=True)
    f.close()


def _acquire(run_dir: Path, hint: str = "or train into another --run-dir"):
    path = lock_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        f = open(path, "a+")  # noqa: SIM115 - the lock, held until released
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = _holder(f.read())
            f.close()
            raise UserError(
                f"run directory {run_dir} is in use by {holder} (lock {path}); wait for it to end, {hint}"
            ) from None
        try:  # the file locked must still be the one at the path: a run ending removes it
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()
    f.seek(0)
    previous = f.read()
    if previous.strip():  # the last holder died without releasing: its lock went with it
        warnings.warn(
            f"run directory {run_dir}: taking over from {_holder(previous)}, which ended without releasing it",
            FrugalityWarning,
            stacklevel=3,
        )
    f.seek(0)
    f.truncate()
    f.write(
        json.dumps(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started": datetime.datetime.now().isoformat(timespec="seconds"),
            }
        )
    )
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
        then, source = _trained_with(latest, run_dir)
        now = _as_dict(recipe)
        _check_compatible(then, now, run_dir, source)
        changes = tuple(d for d in differences(then, now) if d.split(" ", 1)[0] not in ("name",))
        edits = tuple(_unused_edits(run_dir, now))
        kept = None
        if edits:
            kept = run_dir / "recipe.edited.toml"
            number = 1
            while kept.exists():  # never over an earlier one
                number += 1
                kept = run_dir / f"recipe.edited-{number}.toml"
        return RunPlan(run_dir, latest, None, changes, edits, kept)
    check_run_dir(run_dir, fresh, resumable=latest is not None, locked_here=True)
    aside = None
    if _contents(run_dir):  # --fresh never deletes: the old run moves to a dated sibling
        aside = run_dir.with_name(f"{run_dir.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}")
        number = 1
        while aside.exists():  # (a second start within the second: never over the first)
            number += 1
            aside = run_dir.with_name(f"{run_dir.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}-{number}")
    return RunPlan(run_dir, None, aside)


# What a folder may hold and still count as empty for a new run: what file systems and
# desktops leave (dot files, lost+found) and the supervisor's record of this run's attempts.
SUPERVISOR_FILES = ("attempts.jsonl",)


def _contents(run_dir: Path) -> list[str]:
    """The names in `run_dir` that a new run would have to move aside ([] if it is absent)."""
    if not run_dir.is_dir():
        return []
    return sorted(
        p.name
        for p in run_dir.iterdir()
        if not p.name.startswith(".") and p.name != "lost+found" and p.name not in SUPERVISOR_FILES
    )


def is_run(run_dir: Path) -> bool:
    """Whether `run_dir` holds a frugality run: its recipe.toml as `train` writes it (the
    hash line first), or checkpoints of its own (step folders with DCP's index). Another
    tool's folder (an exported model, a Lightning run with its checkpoints/) is not one."""
    return run_of_recipe_file(run_dir / RECIPE_FILE) is not None or bool(
        CheckpointManager(run_dir / "checkpoints").complete()
    )


def check_run_dir(run_dir: Path, fresh: bool, resumable: bool | None = None, locked_here: bool = False) -> None:
    """Refuse, before anything is written, a run directory that is a file, a folder of
    something else (an exported model, the user's files: never moved, --fresh or not), and
    a run with no checkpoint to resume unless --fresh asks to start over. `resumable`:
    whether a checkpoint verifies (default: whether a complete one exists, unhashed);
    `locked_here`: this process holds the run's lock (else another that does is named first)."""
    check_output_folder(run_dir, "run directory")
    found = _contents(run_dir)
    if not found:
        return
    if not is_run(run_dir):
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise UserError(
            f"run directory {run_dir} holds files that are not a frugality run ({shown}); "
            "choose another --run-dir (nothing was moved)"
        )
    if resumable is None:
        resumable = bool(CheckpointManager(run_dir / "checkpoints").complete())
    if not fresh and not resumable:
        if not locked_here:
            _check_not_held(run_dir)  # (a run still before its first checkpoint: not to be started over)
        raise UserError(
            f"run directory {run_dir} holds a run with no usable checkpoint to resume; --fresh starts "
            f"over (the old run is kept as {run_dir.name}.prev-DATE), or choose another --run-dir"
        )


def _check_not_held(run_dir: Path) -> None:
    """A UserError naming the process that holds the run's lock, if one does."""
    try:
        f = open(lock_path(run_dir))  # noqa: SIM115 - `with f` below, once it opened
    except OSError:
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(
                f"run directory {run_dir} is in use by {_holder(f.read())} (lock {lock_path(run_dir)}); wait for it "
                "to end, or train into another --run-dir"
            ) from None
        fcntl.flock(f, fcntl.LOCK_UN)


def open_run(plan: RunPlan, recipe: Recipe, resume_step: int | None) -> None:
    """Create or tidy the run directory once the plan is final."""
    if plan.moved_aside is not None:
        plan.path.rename(plan.moved_aside)
    plan.path.mkdir(parents=True, exist_ok=True)
    recipe_file = plan.path / RECIPE_FILE
    if plan.edited_kept_as is not None:  # never lost: the edited file stays beside the new one
        recipe_file.rename(plan.edited_kept_as)
    body = recipe.to_toml()
    header = _RECIPE_HEADER.format(path=recipe_file)
    write_atomically(recipe_file, f"{_HASH_PREFIX}{_sha256(body)}\n{header}{body}")
    if resume_step is not None:
        _truncate_metrics(plan.path / METRICS_FILE, resume_step)


def write_summary(run_dir: Path, summary: dict) -> None:
    """summary.json, atomically; a value that is not a finite number is written as null."""
    write_atomically(run_dir / SUMMARY_FILE, json.dumps(_finite(summary), indent=2, allow_nan=False) + "\n")


def read_summary(run_dir: Path) -> dict:
    """The run's summary.json, or {} when there is none (or it cannot be read)."""
    try:
        return json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _as_dict(recipe: Recipe) -> dict:
    """The recipe as its TOML file and its checkpoints hold it."""
    return recipe.model_dump(mode="json", exclude_none=True)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _trained_with(checkpoint: Path, run_dir: Path) -> tuple[dict, str]:
    """The recipe the checkpoint was trained with (its own record; checkpoints older than
    that record: the run's recipe.toml), and where it was read."""
    try:
        recorded = read_extra(checkpoint).get("recipe")
    except (Exception, CheckpointException):  # noqa: BLE001 - reported as it should be when the checkpoint loads
        recorded = None
    if isinstance(recorded, dict):
        return recorded, f"its checkpoint {checkpoint.name}"
    try:
        return tomllib.loads((run_dir / RECIPE_FILE).read_text()), RECIPE_FILE
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"run directory {run_dir}: cannot read {RECIPE_FILE} to resume ({e})") from None


def _check_compatible(then: dict, now: dict, run_dir: Path, source: str) -> None:
    for key in differences({k: then.get(k) for k in _MUST_MATCH}, {k: now.get(k) for k in _MUST_MATCH}):
        if key.split(" ", 1)[0] in _MAY_CHANGE:
            continue
        name, _, change = key.partition(" ")
        was, _, is_now = change.partition(" -> ")
        raise UserError(
            f"run directory {run_dir} was trained with another {name} ({was} in {source}, "
            f"{is_now} now); resume with the same recipe, or start over with --fresh "
            "(the old run is kept aside)"
        )


def differences(then: object, now: object, prefix: str = "") -> list[str]:
    """'key then -> now' for every leaf that differs, in key order ('(unset)' where absent)."""
    if isinstance(then, dict) and isinstance(now, dict):
        found = []
        for k in sorted(set(then) | set(now)):
            if then.get(k, _UNSET) != now.get(k, _UNSET):
                found += differences(then.get(k, _UNSET), now.get(k, _UNSET), f"{prefix}.{k}" if prefix else k)
        return found
    return [f"{prefix} {_show(then)} -> {_show(now)}"]


_UNSET = object()


def _show(value: object) -> str:
    return "(unset)" if value is _UNSET else json.dumps(value)


def run_of_recipe_file(path: str | Path) -> Path | None:
    """The run directory whose recipe file this is (one `frugality train` wrote, edited or
    not: it starts with the hash line), else None: training from a run's own recipe file
    trains that run, wherever `train.runs_dir` and the recipe's name would point."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            first = f.readline()
    except OSError:
        return None
    return path.parent if first.startswith(_HASH_PREFIX) else None


def _unused_edits(run_dir: Path, now: dict) -> list[str]:
    """What a hand edit changed in the run's recipe.toml that this run's recipe does not
    have ('key in the file -> this run'); nothing when the file is as written (its hash line
    matches) or says what this run says."""
    try:
        text = (run_dir / RECIPE_FILE).read_text()
    except OSError:
        return []
    first, _, body = text.partition("\n")
    if not first.startswith(_HASH_PREFIX):
        return []  # written before the hash line: edits cannot be told apart
    body = body.split("\n", _RECIPE_HEADER.count("\n"))[-1]
    if first.removeprefix(_HASH_PREFIX).strip() == _sha256(body):
        return []
    try:
        edited = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        return [f"(not valid TOML: {e})"]
    return differences(edited, now)


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
    write_atomically(path, "".join(kept))


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
        found.append(
            {"run_dir": str(run_dir), "pid": info["pid"], "started": info.get("started"), **_progress(run_dir)}
        )
    return found


def _alive(pid: object) -> bool:
    """Whether `pid` (as a lock file holds it: anything) is a live process here."""
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
    """Step, total steps, tokens/s and ETA from the log's last train record; for a server
    (`frugality serve`), its address and request rate from its last serve record."""
    last = serving = None
    try:
        with open(run_dir / METRICS_FILE, "rb") as f:  # the log's tail: it grows for the whole run
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            for line in f.read().decode("utf-8", "replace").splitlines():
                if '"kind": "train"' in line:
                    last = line
                elif '"kind": "serve"' in line:
                    serving = line
    except OSError:
        pass
    if serving is not None:
        try:
            record = json.loads(serving)
            return {
                "serving": record.get("url"),
                "requests_per_s": record.get("requests_per_s"),
                "requests": record.get("requests"),
                "step": None,
                "total_steps": None,
                "tokens_per_s": None,
                "eta_s": None,
            }
        except ValueError:  # a line being written
            pass
    try:
        total = tomllib.loads((run_dir / RECIPE_FILE).read_text()).get("train", {}).get("steps")
    except (OSError, ValueError):
        return {"step": None, "total_steps": None, "tokens_per_s": None, "eta_s": None}
    try:
        record = json.loads(last) if last else {}
    except ValueError:  # a line being written
        record = {}
    step, seconds = record.get("step"), record.get("step_time_s")
    eta = (total - step) * seconds if isinstance(total, int) and step is not None and seconds else None
    return {
        "step": step,
        "total_steps": total,
        "tokens_per_s": record.get("tokens_per_s"),
        "eta_s": None if eta is None else round(eta, 1),
    }
