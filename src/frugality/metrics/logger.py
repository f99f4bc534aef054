"""The run log: one JSON object per line in `metrics.jsonl`, and the same scalars as
TensorBoard events in the run directory (`tensorboard --logdir runs/`)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

from frugality.paths import NamedFile, naming


class RunLogger:
    def __init__(self, run_dir: Path, tensorboard: bool = True) -> None:
        path = run_dir / "metrics.jsonl"
        with naming(path):
            self._jsonl = NamedFile(open(path, "a", buffering=1), path)  # noqa: SIM115 - the log's, closed by close
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: ~1 s

            self._tb = SummaryWriter(log_dir=str(run_dir))

    def log(self, kind: str, step: int, values: Mapping[str, object]) -> None:
        """kind: 'train', 'eval', ...; the values as JSON (None where a figure is unknown); the
        numbers appear in TensorBoard as kind/name."""
        record = {"kind": kind, "step": step, **{k: _finite(v) for k, v in values.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for name, value in values.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{kind}/{name}", value, step)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def _finite(value: object) -> object:
    """JSON has no NaN or Infinity; write them as strings so every line stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
