"""`frugality bench scale`: training throughput at 1, 2, ... processes of this machine, per
data-parallel strategy, each configuration a real `frugality train --nproc N` run of the
recipe in a temporary directory.

The global batch stays the recipe's, so every configuration trains the same samples per
step (in micro-batches of one size: the recipe's, or the global batch over the most ranks); on CPUs the machine's cores are split between the ranks (OMP_NUM_THREADS = cores / N),
so that one process is not given the whole machine against N that share it. Reported per
configuration: median global tokens/s, per rank, scaling efficiency against one process
(tokens/s over N x the one-process rate per core share: 1.0 is linear), and rank 0's
peak memory. Time in communication is not separated out here (no profiler in the loop).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from frugality.config.recipe import Recipe
from frugality.errors import UserError


@dataclass
class ScaleRow:
    strategy: str
    nproc: int
    threads_per_rank: int
    tokens_per_s: float
    tokens_per_s_per_rank: float
    efficiency: float | None  # against one process
    peak_memory_bytes_rank0: int | None
    step_time_s: float


def bench_scale(recipe_arg: str | None, recipe: Recipe, overrides: list[str], nprocs: list[int],
                strategies: list[str], steps: int, log=print) -> list[ScaleRow]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # one micro-batch size for every configuration: the recipe's, or smaller where the most
    # ranks would not divide the global batch with it (one process then accumulates)
    data, most = recipe.data, max(nprocs)
    micro = data.micro_batch_size
    if data.global_batch_size % (micro * most):
        if data.global_batch_size % most:
            raise UserError(f"--nproc {most}: does not divide data.global_batch_size ({data.global_batch_size})")
        micro = data.global_batch_size // most
    overrides = [*overrides, f"data.micro_batch_size={micro}"]
    rows: list[ScaleRow] = []
    base = None  # one process's tokens/s
    for strategy in strategies:
        for n in nprocs:
            if n == 1 and base is not None:
                continue  # one process is the same run under every strategy
            summary = _run(recipe_arg, overrides, n, strategy, steps, max(1, cores // n))
            tps = summary["median_tokens_per_s"]
            if n == 1:
                base = tps
            rows.append(ScaleRow(strategy if n > 1 else "none", n, max(1, cores // n), tps, round(tps / n, 1),
                                 round(tps / base, 3) if base else None,
                                 summary["memory"].get("peak_memory_bytes"), summary["median_step_time_s"]))
            log(f"{rows[-1].strategy:5} x{n}: {tps:,.0f} tokens/s")
    return rows


def _run(recipe_arg, overrides, nproc, strategy, steps, threads) -> dict:
    with tempfile.TemporaryDirectory(prefix="frugality-scale-") as scratch:
        run_dir = Path(scratch) / "run"
        sets = [*overrides, f"train.steps={steps}", f"train.eval_interval={steps}", "train.eval_batches=1",
                f"train.save_interval={steps}", f"parallel.data={strategy}", "optim.warmup_steps=0"]
        command = [sys.executable, "-m", "frugality", "train", *([recipe_arg] if recipe_arg else []),
                   "--run-dir", str(run_dir), "--no-progress", "--nproc", str(nproc),
                   *(a for s in sets for a in ("--set", s))]
        done = subprocess.run(command, capture_output=True, text=True,
                              env=os.environ | {"OMP_NUM_THREADS": str(threads)})
        if done.returncode != 0:
            raise RuntimeError(f"{strategy} x{nproc} failed:\n{done.stderr[-2000:]}")
        return json.loads((run_dir / "summary.json").read_text())


def markdown_table(rows: list[ScaleRow]) -> str:
    lines = ["| strategy | processes | threads each | tokens/s | per rank | scaling efficiency | step (s) "
             "| peak memory, rank 0 (GiB) |", "|" + "---|" * 8]
    for r in rows:
        mem = f"{r.peak_memory_bytes_rank0 / 2**30:.2f}" if r.peak_memory_bytes_rank0 else "n/a"
        eff = f"{r.efficiency:.2f}" if r.efficiency is not None else "n/a"
        lines.append(f"| {r.strategy} | {r.nproc} | {r.threads_per_rank} | {r.tokens_per_s:,.0f} | "
                     f"{r.tokens_per_s_per_rank:,.0f} | {eff} | {r.step_time_s:.3f} | {mem} |")
    return "\n".join(lines)


def rows_json(rows: list[ScaleRow]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=1)
