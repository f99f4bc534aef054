"""Checkpoints through `torch.distributed.checkpoint` (DCP).

DCP works in one process and, with several, writes each rank's shards in parallel and can
load them back at another world size. Model and optimizer state go through DCP's
`get_state_dict`/`set_state_dict`, which name everything by the plain module path (no
`_orig_mod.` from torch.compile, no DDP/FSDP prefixes) and key optimizer state by
parameter name rather than position. Tensors load onto whatever device the live model is
on, so a checkpoint saved on CUDA resumes on a CPU.

A checkpoint is a folder `step_00001000/`. It is written as `.step_00001000.partial/`:
each rank fsyncs and hashes (SHA-256) the files it wrote, rank 0 writes `manifest.json`
with every file's size and hash last, fsynced, and renames the folder into place (then
fsyncs the parent), so a crash mid-save never leaves a checkpoint that looks usable.
Before a checkpoint is resumed its files are checked against the manifest: a truncated or
corrupt newest checkpoint is skipped, with a warning, for the newest one that verifies.
Checkpoints written before manifests existed (a `.metadata` alone) are used unverified.

Nothing in a checkpoint can run code when it is read: the training state is JSON, and DCP's
pickled `.metadata` and non-tensor values are read through allow-lists (`checkpoint.safe`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import warnings
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

# DCP's save and load from the modules that export them (its package re-exports them without an __all__)
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from frugality.checkpoint.safe import SafePlanner, SafeReader, UnsafeCheckpointError, legacy_state, read_metadata
from frugality.errors import FrugalityWarning, UserError
from frugality.paths import fsync_dir

_NAME = re.compile(r"^step_(\d{8,})$")
MANIFEST = "manifest.json"


class CorruptCheckpointWarning(FrugalityWarning):
    pass


class LegacyCheckpointWarning(FrugalityWarning):
    """A checkpoint from before training state was JSON; it is read as plain data only."""


class CheckpointManager:
    def __init__(self, folder: str | Path, keep: int = 2) -> None:
        self.folder = Path(folder)
        self.keep = keep
        # Called (step, partial folder) between a save's shard files and its manifest: the
        # seam where the fault-injection suite kills a rank or fills the disk mid-save.
        self.on_files_written = None
        # (step, final, partial, future) of an asynchronous save in flight
        self._pending: tuple[int, Path, Path, Future] | None = None
        self._groups: dict[str, dist.ProcessGroup] | None = None  # gloo: the training thread's, asynchronous saves

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return self._step_folders(".metadata")

    def _step_folders(self, *marks: str) -> list[Path]:
        """Step folders (holding any of the files `marks`, where given), oldest first."""
        if not self.folder.is_dir():
            return []
        found = [
            p
            for p in self.folder.iterdir()
            if _NAME.match(p.name) and p.is_dir() and (not marks or any((p / m).is_file() for m in marks))
        ]
        return sorted(found, key=step_of)

    def latest(self) -> Path | None:
        """The newest checkpoint whose files verify; newer step folders that do not (one
        lacking its `.metadata` included) are skipped with a warning naming them and what is
        wrong."""
        for path in reversed(self._step_folders()):
            problem = verify(path)
            if problem is None:
                return path
            warnings.warn(
                f"checkpoint {path} is unusable ({problem}); trying the one before it",
                CorruptCheckpointWarning,
                stacklevel=2,
            )
        return None

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: dict,
        *,
        asynchronous: bool = False,
    ) -> Path:
        """Write model, optimizer and `extra` (training state as plain JSON) for `step`.

        `asynchronous`: copy the state to host memory and write it from a background thread
        (DCP's `async_save`, on a gloo process group of its own so that its collectives never mix
        with training's); the checkpoint is completed — hashed, its manifest written, renamed
        into place — by `poll()` at the first step after the write ends, or by `wait()`. One
        save is in flight at most: the next one waits for it."""
        self.wait()
        final = self.folder / f"step_{step:08d}"
        partial = self.folder / f".{final.name}.partial"
        if _is_main():
            for stale in self.folder.glob(".step_*.partial"):  # left by a crash mid-save
                shutil.rmtree(stale, ignore_errors=True)
        short = self._space_problem(final)
        if dist.is_initialized():  # every rank stops, or none; no rank writes before the stale folders are gone
            flag = torch.tensor([1 if short else 0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._host_group())
            if flag.item() and not short:
                short = f"cannot write checkpoint {final}: another rank lacks the space for it"
        if short:
            raise UserError(short)
        model_state, optim_state = _get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "extra": json.dumps(extra).encode()}
        try:
            with single_process_ok():
                if asynchronous:
                    response = state_dict_saver.async_save(
                        state,
                        checkpoint_id=partial,
                        process_group=self._host_group("async"),
                        no_dist=not dist.is_initialized(),
                    )
                    upload = cast(Future, getattr(response, "upload_completion", response))
                    self._pending = (step, final, partial, upload)
                    return final
                state_dict_saver.save(state, checkpoint_id=partial, no_dist=not dist.is_initialized())
        except (OSError, CheckpointException) as e:
            raise self._failed(final, partial, e) from None
        self._finish(step, final, partial)
        return final

    def poll(self) -> None:
        """Complete an asynchronous save whose files are written (on every rank: they agree
        first), else return at once. Call it at the same point on every rank."""
        if self._pending is None:
            return
        done = torch.tensor([1 if self._pending[3].done() else 0])
        if dist.is_initialized():
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._host_group())
        if done.item():
            self.wait()

    def wait(self) -> None:
        """Block until an asynchronous save is written, then complete it."""
        if self._pending is None:
            return
        step, final, partial, upload = self._pending
        self._pending = None
        try:
            upload.result()
        except (OSError, CheckpointException) as e:
            raise self._failed(final, partial, e) from None
        self._finish(step, final, partial)

    def abandon(self) -> None:
        """After an error: let a write in flight end (its partial folder is removed by the
        next save), without the collectives that completing it takes."""
        if self._pending is not None:
            upload, self._pending = self._pending[3], None
            with suppress(Exception):  # the run is failing already; its error is the one to report
                upload.result()

    def _host_group(self, purpose: str = "agree") -> dist.ProcessGroup | None:
        """Gloo groups of all ranks for host-memory collectives, one per thread that uses
        them (collectives of two threads on one group can pair up wrongly and hang): "agree"
        for the small agreements of the training thread (the default group may be NCCL,
        which has no CPU tensors), "async" for the background thread of asynchronous saves."""
        if not dist.is_initialized():
            return None
        if self._groups is None:  # made once, by every rank at its first save
            # every rank is in both: new_group gives each a group, never its non-member mark
            self._groups = {
                "agree": cast(dist.ProcessGroup, dist.new_group(backend="gloo")),
                "async": cast(dist.ProcessGroup, dist.new_group(backend="gloo")),
            }
        return self._groups[purpose]

    def _finish(self, step: int, final: Path, partial: Path) -> None:
        """Hash and fsync each rank's files, write the manifest last, rename into place,
        prune: what makes a written checkpoint a complete one."""
        try:
            rank = dist.get_rank() if dist.is_initialized() else 0
            if self.on_files_written is not None:
                self.on_files_written(step, partial)
            mine = {f.name: _file_record(f) for f in sorted(partial.glob(f"__{rank}_*"))}
        except (OSError, CheckpointException) as e:
            raise self._failed(final, partial, e) from None
        if dist.is_initialized():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        if _is_main():
            parts = cast(list[dict], gathered)  # filled in by all_gather_object
            files = {name: record for part in parts for name, record in part.items()}
            try:
                files[".metadata"] = _file_record(partial / ".metadata")
                _write_synced(partial / MANIFEST, json.dumps({"step": step, "files": files}, indent=1).encode())
            except OSError as e:
                raise self._failed(final, partial, e) from None
            if final.exists():  # re-saving a step (e.g. after a resume): replace it whole
                shutil.rmtree(final)
            partial.rename(final)
            fsync_dir(self.folder)
            # older than the checkpoints kept: complete ones, and step folders a crash or an
            # older version left without .metadata
            done = self.complete()
            oldest_kept = step_of(done[-self.keep]) if len(done) >= self.keep else 0
            for old in self.folder.iterdir():
                if _NAME.match(old.name) and step_of(old) < oldest_kept:
                    shutil.rmtree(old, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()

    def _space_problem(self, final: Path) -> str | None:
        """Said before writing: the newest checkpoint's size (its manifest) against the free
        space. None when it fits or nothing is known yet."""
        previous = next((p for p in reversed(self.complete()) if (p / MANIFEST).is_file()), None)
        if previous is None:
            return None
        try:
            files = json.loads((previous / MANIFEST).read_text())["files"]
        except (OSError, ValueError, KeyError):
            return None
        # The whole checkpoint: ranks write into one folder, on one (shared) file system.
        need = sum(r["size"] for r in files.values())
        free = shutil.disk_usage(self.folder).free
        if free >= need * 1.05:  # manifests and file-system slack
            return None
        return (
            f"cannot write checkpoint {final}: {_human(free)} free on the device holding "
            f"{self.folder}, the checkpoint needs ~{_human(need)} (as {previous.name}); "
            f"the previous checkpoint {previous.name} is intact"
        )

    def _failed(self, final: Path, partial: Path, error: BaseException) -> BaseException:
        """A save that failed: its partial folder removed, and for a filesystem fault one
        line naming the checkpoint, the cause and what is still there (other errors as
        they were)."""
        cause = (
            error
            if isinstance(error, OSError)
            else next((f[0] for f in getattr(error, "failures", {}).values() if isinstance(f[0], OSError)), None)
        )
        if cause is None and _out_of_space(self.folder):  # asked before the partial folder frees its space
            # torch.save's zip writer reports a full disk as "unexpected pos" (a RuntimeError)
            cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if _is_main():
            shutil.rmtree(partial, ignore_errors=True)
        if cause is None:
            return error
        free = shutil.disk_usage(self.folder).free if self.folder.exists() else 0
        previous = self.latest()
        return UserError(
            f"cannot write checkpoint {final}: {cause.strerror or cause} ({free / 2**30:.1f} GiB free "
            f"on the device holding {self.folder}); "
            + (f"the previous checkpoint {previous.name} is intact" if previous else "no earlier checkpoint")
        )

    def load(self, path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Restore model and optimizer in place; return the saved `extra` state. Nothing in
        the files can run code (`frugality.checkpoint.safe`)."""
        path = Path(path)
        model_state, optim_state = _get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state, "extra": b""}
        safe_load(state, path)
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        # DCP keeps one rank's copy of the param groups' list: under pipeline parallel that
        # rank's stage names only, so the other stages' groups come back without their
        # hyperparameters. They are the checkpoint's groups' (same order on every rank: decay,
        # no decay), and where it has none, this run's own.
        saved = state["optim"].get("param_groups") if isinstance(state["optim"], dict) else None
        saved = saved if isinstance(saved, list) and len(saved) == len(optimizer.param_groups) else [{}] * len(hyper)
        for group, stored, before in zip(optimizer.param_groups, saved, hyper, strict=True):
            for key, value in (stored or {}).items():
                if key != "params":
                    group.setdefault(key, value)
            for key, value in before.items():
                group.setdefault(key, value)
        extra = state["extra"]
        if not isinstance(extra, bytes):
            raise UserError(f"checkpoint {path}: its training state is a {type(extra).__name__}, not JSON")
        if extra.startswith(b"{"):
            return json.loads(extra)
        legacy = legacy_state(extra, path)  # refused before anything is said when it is not plain data
        warnings.warn(
            f"checkpoint {path} was written by an older frugality (training state pickled); "
            "read as plain data only. The next checkpoint is written as JSON.",
            LegacyCheckpointWarning,
            stacklevel=2,
        )
        return legacy


def _get_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """DCP's `get_state_dict`. An optimizer that has not stepped yet (every step so far
    skipped: amp-fp16's overflows, bad steps) is first given its state by a step at learning
    rate 0, which counts as a step: Adam's first real update would then be its second,
    with another bias correction. The state is put back to zeros (in place: the live
    optimizer's and the saved tensors are the same), so that a checkpoint taken before any
    update resumes to the bits of a run that took none."""
    fresh = not optimizer.state
    model_state, optim_state = get_state_dict(model, optimizer)
    if fresh:  # zeros: the Adam family's state before its first update (the moments, for Adam's
        for state in optimizer.state.values():  # coupled weight decay, took decay * weights)
            for value in state.values():
                if torch.is_tensor(value):
                    value.zero_()
    return model_state, optim_state


def safe_load(state: dict, path: Path, *, no_dist: bool | None = None) -> None:
    """`dcp.load` into `state` in place, with `.metadata` and non-tensor values read as
    plain data only. `no_dist`: every process reads alone (default: together when a process
    group exists)."""
    if no_dist is None:
        no_dist = not dist.is_initialized()
    try:
        with single_process_ok():
            state_dict_loader.load(state, storage_reader=SafeReader(path), planner=SafePlanner(path), no_dist=no_dist)
    except CheckpointException as e:  # DCP wraps what each rank raised: ours is the message
        ours = next((f[0] for f in e.failures.values() if isinstance(f[0], UserError)), None)
        if ours is None:
            raise
        raise ours from None


def verify(path: Path) -> str | None:
    """None when every file of the checkpoint has its manifest's size and SHA-256 (or, for
    a checkpoint without a manifest, its `.metadata` exists); else what is wrong."""
    manifest = path / MANIFEST
    if not (path / ".metadata").is_file():
        return (
            "no .metadata: DCP's index of the checkpoint was deleted"
            if manifest.is_file()
            else "no .metadata: an incomplete save"
        )
    if not manifest.is_file():  # older than manifests, or its manifest deleted: check what .metadata says
        return _check_against_metadata(path)
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    for name, record in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != record["size"]:
            return f"{name} has {f.stat().st_size:,} bytes, the manifest {record['size']:,}"
        if _sha256(f) != record["sha256"]:
            return f"{name} does not match its SHA-256"
    return None


def _check_against_metadata(path: Path) -> str | None:
    """Without a manifest: every file `.metadata` points into exists and holds the bytes it
    names (a truncated or missing shard file shows; changed bytes of the right length do not)."""
    try:
        storage = read_metadata(path).storage_data or {}
    except UnsafeCheckpointError:
        raise  # asked to run code: refused, as a load would refuse it, never skipped for an older one
    except (OSError, UserError) as e:
        return f".metadata is unreadable ({e})"
    needed: dict[str, int] = {}
    for info in storage.values():
        name = str(info.relative_path)
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(needed.items()):
        f = path / name
        if not f.is_file():
            return f"{name} is missing (no manifest; checked against .metadata)"
        if f.stat().st_size < end:
            return f"{name} has {f.stat().st_size:,} bytes, .metadata points up to byte {end:,} (no manifest)"
    return None


def read_extra(path: str | Path) -> dict:
    """A checkpoint's training state (the `extra` of `save`) alone, without its tensors."""
    path = Path(path)
    state: dict[str, Any] = {"extra": b""}
    safe_load(state, path, no_dist=True)
    extra = state["extra"]
    if isinstance(extra, bytes) and extra.startswith(b"{"):
        return json.loads(extra)
    return legacy_state(extra, path) if isinstance(extra, bytes) else {}


def _out_of_space(folder: Path) -> bool:
    """Whether `folder`'s file system is full now: a small probe file cannot be written."""
    probe = folder / f".space-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
        return False
    except OSError as e:
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    finally:
        probe.unlink(missing_ok=True)


def _human(size: float) -> str:
    if size < 1024:
        return f"{size:,.0f} B"
    for unit in ("KiB", "MiB"):
        size /= 1024
        if size < 1024:
            return f"{size:,.1f} {unit}"
    return f"{size / 1024:,.1f} GiB"


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _file_record(path: Path) -> dict:
    """Size and hash of a file just written, after forcing it to disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def step_of(path: Path) -> int:
    match = _NAME.match(path.name)
    assert match is not None, f"{path} is not a checkpoint folder"  # (callers pass those only)
    return int(match.group(1))


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


@contextmanager
def single_process_ok():
    """DCP warns on every call without a process group that it assumes one process; we mean that."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single")
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")  # DCP's own call, torch 2.9
        yield
