"""Checkpoints through `torch.distributed.checkpoint` (DCP).

DCP works in one process and, with several, writes each rank's shards in parallel and can
load them back at another world size. Model and optimizer state go through DCP's
`get_state_dict`/`set_state_dict`, which name everything by the plain module path (no
`_orig_mod.` from torch.compile, no DDP/FSDP prefixes) and key optimizer state by
parameter name rather than position. Tensors load onto whatever device the live model is
on, so a checkpoint saved on CUDA resumes on a CPU.

A checkpoint is a folder `step_00001000/`. It is written as `.step_00001000.partial/`
and renamed into place only when complete, so a crash mid-save never leaves a
checkpoint that looks usable.
"""

from __future__ import annotations

import pickle
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

_NAME = re.compile(r"^step_(\d{8,})$")


class CheckpointManager:
    def __init__(self, folder: str | Path, keep: int = 2) -> None:
        self.folder = Path(folder)
        self.keep = keep

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.folder.is_dir():
            return []
        found = [
            p for p in self.folder.iterdir() if _NAME.match(p.name) and (p / ".metadata").is_file()
        ]
        return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def save(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict
    ) -> Path:
        """Write model, optimizer and `extra` (any picklable training state) for `step`."""
        final = self.folder / f"step_{step:08d}"
        partial = self.folder / f".{final.name}.partial"
        if _is_main():
            shutil.rmtree(partial, ignore_errors=True)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "extra": pickle.dumps(extra)}
        with single_process_ok():
            dcp.save(state, checkpoint_id=partial, no_dist=not dist.is_initialized())
        if _is_main():
            if final.exists():  # re-saving a step (e.g. after a resume): replace it whole
                shutil.rmtree(final)
            partial.rename(final)
            for old in self.complete()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()
        return final

    def load(self, path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Restore model and optimizer in place; return the saved `extra` state."""
        model_state, optim_state = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state, "extra": b""}
        with single_process_ok():
            dcp.load(state, checkpoint_id=Path(path), no_dist=not dist.is_initialized())
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        return pickle.loads(state["extra"])


def step_of(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


@contextmanager
def single_process_ok():
    """DCP warns on every call without a process group that it assumes one process; we mean that."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single")
        yield
