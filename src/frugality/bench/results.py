"""Where the benchmark scripts write their tables (benchmarks/results/<kind>-<recipe>-<machine>-
<date>), and how the per-path micro-benchmarks time their paths."""

from __future__ import annotations

import datetime
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from frugality.backends import backend
from frugality.hardware import device_name
from frugality.paths import write_atomically


def machine_line() -> str:
    """The machine, its threads, the OS and torch, today: the first line under a table's title."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return (
        f"Machine: {device_name(device)}, {os.cpu_count()} cores ({torch.get_num_threads()} torch "
        f"threads), {platform.system()} {platform.machine()}; torch {torch.__version__}; "
        f"{datetime.date.today().isoformat()}."
    )


def write_results(folder: Path, kind: str, recipe: str, header: str, table: str, rows_json: str) -> Path:
    """Write `<stem>.md` (header + table) and `<stem>.json`, print the table; returns the stem."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    slug = re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")
    stem = folder / f"{kind}-{recipe}-{slug}-{datetime.date.today().isoformat()}"
    write_atomically(stem.with_suffix(".md"), header + table + "\n")
    write_atomically(stem.with_suffix(".json"), rows_json + "\n")
    print(header + table)
    print(f"\nwrote {stem}.md and .json", file=sys.stderr)
    return stem


def synchronize(device: torch.device) -> None:
    """Wait for what `device` was given to finish: a clock stopped before that times the
    launch, not the work (CUDA queues kernels; XLA traces a graph and runs it at a sync)."""
    backend(device).synchronize()


def race(device: torch.device, repeats: int, **paths) -> dict[str, float]:
    """Median seconds of each path (a callable), alternating, after one warm-up call each:
    on a shared machine whose speed drifts, alternation makes the paths share the drift."""
    for fn in paths.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}
