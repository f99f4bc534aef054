"""`frugality bench scale`: training throughput at 1, 2, ... processes of this machine, per
data-parallel strategy, each configuration a real `frugality train --nproc N` run of the
recipe in a temporary directory.

The global batch stays the recipe's, so every configuration trains the same samples per
step (in micro-batches of one size: the recipe's, or the global batch over the most ranks); on CPUs the
machine's cores are split between the ranks (OMP_NUM_THREADS = cores / N),
so that one process is not given the whole machine against N that share it. Reported per
configuration: median global tokens/s, per rank, scaling efficiency against one process
(tokens/s over N x the one-process rate per core share: 1.0 is linear), and rank 0's
peak memory.

Exposed communication: each process count also runs as N independent one-process runs at
once, each with one rank's share of the global batch and of the cores: the same compute
and the same contention for memory bandwidth, without a collective. A strategy's median
step minus theirs is the time its communication (and, for FSDP2, the copies around it)
adds to a step: what overlapping with compute did not hide. The communication hidden
under compute is not measured here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
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
    independent_step_time_s: float | None = None  # N one-process runs of a rank's share, at once
    exposed_communication_s: float | None = None  # step time over the independent runs', or in TP collectives
    tensor: int = 1
    pipeline: int = 1
    pipeline_bubble: float | None = None  # measured share of the schedule's time, the ranks' mean
    bubble_by_rank: list | None = None  # along the pipeline
    ideal_bubble: float | None = None


def bench_scale(
    recipe_arg: str | None,
    recipe: Recipe,
    overrides: list[str],
    nprocs: list[int],
    strategies: list[str],
    steps: int,
    log=print,
    tensors: Sequence[int] = (),
    pipelines: Sequence[int] = (),
    pipeline_microbatches: int | None = None,
) -> list[ScaleRow]:
    for flag, degrees in (("--tensor", tensors), ("--pipeline", pipelines)):
        for d in degrees:
            if not any(n % d == 0 for n in nprocs):
                raise UserError(f"{flag} {d}: divides none of the process counts ({', '.join(map(str, nprocs))})")
    for n in nprocs:  # a layout the model cannot take fails here, before any run
        for t, p in layouts(n, tensors, pipelines):
            _check_layout(recipe, n, t, p)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # one micro-batch size for every configuration: the recipe's, or smaller where the most
    # ranks would not divide the global batch with it (one process then accumulates)
    data, most = recipe.data, max(nprocs)
    micro = data.micro_batch_size
    if data.global_batch_size % (micro * most):
        if data.global_batch_size % most:
            raise UserError(f"--nproc {most}: does not divide data.global_batch_size ({data.global_batch_size})")
        micro = data.global_batch_size // most
    overrides = [*overrides, f"data.micro_batch_size={micro}", f"train.eval_samples={micro}"]  # one batch
    rows: list[ScaleRow] = []
    base = None  # one process's tokens/s
    independent: dict[int, float] = {}  # process count -> step time without collectives
    for strategy in strategies:
        for n in nprocs:
            if n == 1 and base is not None:
                continue  # one process is the same run under every strategy
            threads = max(1, cores // n)
            summary = _run(recipe_arg, overrides, n, strategy, steps, threads)
            tps, step = summary["median_tokens_per_s"], summary["median_step_time_s"]
            if n == 1:
                base = tps
            elif n not in independent and (data.global_batch_size // n) % micro == 0:  # else not measured
                share = [*overrides, f"data.global_batch_size={data.global_batch_size // n}"]
                independent[n] = _independent_step_time(recipe_arg, share, n, steps, threads)
            alone = independent.get(n)
            rows.append(
                _row(
                    strategy if n > 1 else "none",
                    n,
                    threads,
                    summary,
                    base,
                    independent_step_time_s=alone,
                    exposed_communication_s=round(step - alone, 4) if alone is not None else None,
                )
            )
            log(f"{rows[-1].strategy:5} x{n}: {tps:,.0f} tokens/s")
    for n in nprocs:
        for t, p in layouts(n, tensors, pipelines):
            rows.append(
                _model_parallel_row(
                    recipe_arg, overrides, n, t, p, strategies[0], steps, cores, base, pipeline_microbatches
                )
            )
            log(f"{rows[-1].strategy} x{n}: {rows[-1].tokens_per_s:,.0f} tokens/s")
    return rows


def _row(name: str, n: int, threads: int, summary: dict, base: float | None, **extra) -> ScaleRow:
    """A configuration's row from its run's summary (`base`: one process's tokens/s)."""
    tps = summary["median_tokens_per_s"]
    return ScaleRow(
        name,
        n,
        threads,
        tps,
        round(tps / n, 1),
        round(tps / base, 3) if base else None,
        summary["memory"].get("peak_memory_bytes"),
        summary["median_step_time_s"],
        **extra,
    )


def layouts(n: int, tensors, pipelines) -> list[tuple[int, int]]:
    """The (tensor, pipeline) degrees asked for that `n` processes hold: each alone, then
    each pair; data parallel takes the rest."""
    pairs = [(t, 1) for t in tensors] + [(1, p) for p in pipelines] + [(t, p) for t in tensors for p in pipelines]
    return [(t, p) for t, p in pairs if t * p > 1 and n % (t * p) == 0]


def _check_layout(recipe: Recipe, n: int, t: int, p: int) -> None:
    """The run's layout rules (`runtime.layout.check_layout`), before any process starts."""
    from frugality.distributed import World
    from frugality.runtime.device import resolve_device
    from frugality.runtime.layout import check_layout

    parallel = recipe.parallel.model_copy(update={"tensor": t, "pipeline": p})
    device = resolve_device(recipe.train.device, xla_ok=True)
    check_layout(recipe.model_copy(update={"parallel": parallel}), device, World(0, n))


def layout_name(t: int, p: int, data: int, strategy: str) -> str:
    parts = [f"tp{t}"] * (t > 1) + [f"pp{p}"] * (p > 1) + [f"{strategy}{data}"] * (data > 1)
    return " x ".join(parts)


def _model_parallel_row(recipe_arg, overrides, n, t, p, strategy, steps, cores, base, microbatches) -> ScaleRow:
    threads = max(1, cores // n)
    sets = [*overrides, f"parallel.tensor={t}", f"parallel.pipeline={p}"]
    if p > 1 and microbatches:
        sets.append(f"parallel.pipeline_microbatches={microbatches}")
    summary = _run(recipe_arg, sets, n, strategy, steps, threads)
    figures = summary.get("parallel", {})
    return _row(
        layout_name(t, p, n // (t * p), strategy),
        n,
        threads,
        summary,
        base,
        exposed_communication_s=figures.get("tensor_collectives_s"),
        tensor=t,
        pipeline=p,
        pipeline_bubble=figures.get("bubble"),
        bubble_by_rank=figures.get("bubble_by_rank"),
        ideal_bubble=figures.get("ideal_bubble"),
    )


def _independent_step_time(recipe_arg, overrides, n, steps, threads) -> float:
    """The median step of n one-process runs started together (their mean)."""
    with tempfile.TemporaryDirectory(prefix="frugality-scale-") as scratch:
        runs = [_start(recipe_arg, overrides, 1, "ddp", steps, threads, Path(scratch) / f"run{i}") for i in range(n)]
        summaries = [_finish(*run) for run in runs]
    return sum(s["median_step_time_s"] for s in summaries) / n


def _run(recipe_arg, overrides, nproc, strategy, steps, threads) -> dict:
    with tempfile.TemporaryDirectory(prefix="frugality-scale-") as scratch:
        return _finish(*_start(recipe_arg, overrides, nproc, strategy, steps, threads, Path(scratch) / "run"))


def _start(recipe_arg, overrides, nproc, strategy, steps, threads, run_dir: Path):
    sets = [
        *overrides,
        f"train.steps={steps}",
        f"train.eval_interval={steps}",
        f"train.save_interval={steps}",
        f"parallel.data={strategy}",
        "optim.warmup_steps=0",
    ]
    args = [
        "train",
        *([recipe_arg] if recipe_arg else []),
        "--run-dir",
        str(run_dir),
        "--no-progress",
        "--nproc",
        str(nproc),
        *(a for s in sets for a in ("--set", s)),
    ]
    return launch(args, os.environ | {"OMP_NUM_THREADS": str(threads)}), run_dir, f"{strategy} x{nproc}"


def launch(args: list[str], env: dict) -> subprocess.Popen:
    """`frugality ARGS` in a process of its own (`train --nproc N` starts torchrun), started,
    not awaited: `_finish` reads its stderr and exit status."""
    command = [sys.executable, "-m", "frugality", *args]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)


def _finish(process: subprocess.Popen, run_dir: Path, name: str) -> dict:
    _, stderr = process.communicate()
    if process.returncode != 0:
        # the first traceback (the rank that failed first: the others' errors follow from
        # it), then the end (torchrun's summary)
        first = stderr.find("Traceback")
        head = f"{stderr[first : first + 3000]}\n...\n" if 0 <= first < len(stderr) - 2000 else ""
        raise RuntimeError(f"{name} failed:\n{head}{stderr[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def markdown_table(rows: list[ScaleRow]) -> str:
    lines = [
        "| strategy | processes | threads each | tokens/s | per rank | scaling efficiency | step (s) "
        "| step without collectives (s) | exposed communication (s, share of step) "
        "| pipeline bubble: measured (by rank) / ideal | peak memory, rank 0 (GiB) |",
        "|" + "---|" * 11,
    ]
    for r in rows:
        mem = f"{r.peak_memory_bytes_rank0 / 2**30:.2f}" if r.peak_memory_bytes_rank0 else "n/a"
        eff = f"{r.efficiency:.2f}" if r.efficiency is not None else "n/a"
        alone = f"{r.independent_step_time_s:.3f}" if r.independent_step_time_s is not None else "n/a"
        exposed = (
            f"{r.exposed_communication_s:.3f} ({r.exposed_communication_s / r.step_time_s:.0%})"
            if r.exposed_communication_s is not None
            else "n/a"
        )
        bubble = "n/a"
        if r.pipeline_bubble is not None:
            ranks = ", ".join(f"{b:.0%}" if b is not None else "?" for b in r.bubble_by_rank or [])
            bubble = f"{r.pipeline_bubble:.0%} ({ranks}) / {r.ideal_bubble:.0%}"
        lines.append(
            f"| {r.strategy} | {r.nproc} | {r.threads_per_rank} | {r.tokens_per_s:,.0f} | "
            f"{r.tokens_per_s_per_rank:,.0f} | {eff} | {r.step_time_s:.3f} | {alone} | {exposed} | {bubble} | {mem} |"
        )
    return "\n".join(lines)


def rows_json(rows: list[ScaleRow]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=1)
