"""Fault injection for the reliability suite (`benchmarks/faults.py`, tests): the faults a
production run meets, made to happen at a chosen step so that recovery can be checked.

`FRUGALITY_INJECT_FAULT=KIND@STEP[:RANK]` (rank 0 unless given) makes the run:

- `kill`: SIGKILL itself after step STEP's update, before any checkpoint of it;
- `sigterm`: receive SIGTERM there (a preemption: the run saves and exits 130);
- `kill_in_save`: SIGKILL itself while writing the checkpoint of step STEP (shards written,
  no manifest yet);
- `truncate`: cut a shard of the checkpoint of step STEP in half once it is saved, then
  SIGKILL itself (a disk that lost a write: the resume must skip that checkpoint);
- `enospc`: fail the checkpoint of step STEP with "No space left on device";
- `nan`: put a NaN into the gradients of step STEP (on every rank: the loss is shared);
- `hang`: stop responding in step STEP, for good (the watchdog, `train.step_timeout_s`, ends it).

Each fault fires once per run directory (a marker file `.fault-KIND@STEP` remembers it), so
the rerun that recovers from it runs clean. Unset, nothing here is loaded.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from frugality.errors import UserError
from frugality.training.callbacks import Callback

if TYPE_CHECKING:
    from frugality.runtime.state import TrainState
    from frugality.training.loop import StepResult

ENV_VAR = "FRUGALITY_INJECT_FAULT"
KINDS = ("kill", "sigterm", "kill_in_save", "truncate", "enospc", "nan", "hang")


def parse(spec: str) -> tuple[str, int, int]:
    try:
        kind, where = spec.split("@")
        step, _, rank = where.partition(":")
        kind, step, rank = kind.strip(), int(step), int(rank or 0)
    except ValueError:
        raise UserError(f"{ENV_VAR}={spec!r}: expected KIND@STEP[:RANK], e.g. kill@6:1") from None
    if kind not in KINDS:
        raise UserError(f"{ENV_VAR}={spec!r}: unknown fault {kind!r}; one of {', '.join(KINDS)}")
    return kind, step, rank


class FaultInjector(Callback):
    def __init__(self, spec: str, run_dir: Path, checkpoints) -> None:
        self.kind, self.step, self.rank = parse(spec)
        self.marker = Path(run_dir) / f".fault-{self.kind}@{self.step}"
        self.checkpoints = checkpoints

    def _due(self, state: TrainState, step: int, every_rank: bool = False) -> bool:
        return step == self.step and (every_rank or state.world.rank == self.rank) and not self.marker.exists()

    def _fired(self) -> None:
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        self.marker.write_text("")

    def on_train_start(self, state: TrainState) -> None:
        if self.kind in ("kill_in_save", "enospc"):
            self.checkpoints.on_files_written = lambda step, partial: self._in_save(state, step)
        if self.kind == "nan":
            for p in state.model.parameters():
                p.register_hook(lambda g, state=state: self._poison(state, g))

    def _poison(self, state: TrainState, grad: torch.Tensor) -> torch.Tensor:
        # all ranks alike: the marker is written by rank 0 after the step (on_step_end)
        if state.step + 1 == self.step and not self.marker.exists():
            return torch.full_like(grad, float("nan"))
        return grad

    def _in_save(self, state: TrainState, step: int) -> None:
        if not self._due(state, step):
            return
        self._fired()
        if self.kind == "kill_in_save":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def on_step_end(self, state: TrainState, result: StepResult) -> None:
        if self.kind == "nan" and result.step == self.step and state.world.rank == 0 and not self.marker.exists():
            self._fired()
        if self.kind in ("kill", "sigterm", "hang") and self._due(state, result.step):
            self._fired()
            if self.kind == "hang":
                while True:  # the watchdog's stack dump shows this line
                    time.sleep(60)
            os.kill(os.getpid(), signal.SIGKILL if self.kind == "kill" else signal.SIGTERM)

    def on_step_done(self, state: TrainState) -> None:
        if self.kind == "truncate" and self._due(state, state.step):
            shard = next((self.checkpoints.folder / f"step_{state.step:08d}").glob("*.distcp"), None)
            if shard is not None:  # a step without a checkpoint: nothing to cut
                self._fired()
                shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
                os.kill(os.getpid(), signal.SIGKILL)
