"""`frugality train`: one recipe, one run directory, resumable at any checkpoint.

`train(recipe)` checks everything it can (task, device, tokenizer, dataset, batch shapes)
before it writes anything, builds the training state (`frugality.runtime.state`), restores
a checkpoint or starts from other weights, then runs the loop (`frugality.training.loop`)
with the callbacks that log, report progress, checkpoint and summarise. With a fixed seed a
CPU run is reproducible bit for bit, across a stop and resume too: model, optimizer, data
position and RNG states all live in the checkpoint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch

from frugality import distributed
from frugality.backends import backend
from frugality.checkpoint import CheckpointManager, step_of
from frugality.config.recipe import Recipe
from frugality.data.device_loader import DevicePrefetchStream
from frugality.data.loader import TrainStream
from frugality.errors import UserError
from frugality.hardware import probe
from frugality.health.preflight import preflight
from frugality.interop.weights import (
    WeightsSource,
    carry_description,
    check_compatible,
    load_weights,
    resolve_source,
    stored_dtype,
)
from frugality.runtime.data import open_training_data
from frugality.runtime.host_memory import keep_freed_memory
from frugality.runtime.layout import resolve_layout
from frugality.runtime.state import TrainState, build_state
from frugality.training import rng
from frugality.training import run_dir as rundir
from frugality.training.callbacks import Callbacks
from frugality.training.callbacks.checkpointing import Checkpointing
from frugality.training.callbacks.cost import Cost
from frugality.training.callbacks.divergence import DivergenceGuard
from frugality.training.callbacks.faults import ENV_VAR as FAULT_ENV_VAR
from frugality.training.callbacks.faults import FaultInjector
from frugality.training.callbacks.memory import Memory
from frugality.training.callbacks.parallelism import ParallelFigures
from frugality.training.callbacks.progress import Progress
from frugality.training.callbacks.run_log import CloseCompileSession, RunLog
from frugality.training.callbacks.signals import StopOnSignal
from frugality.training.callbacks.summary import Summary
from frugality.training.callbacks.throughput import Throughput
from frugality.training.callbacks.watchdog import Watchdog
from frugality.training.loop import fit
from frugality.training.restore import load_weights_and_moments, restore


@dataclass
class TrainResult:
    run_dir: Path
    start_step: int
    final_step: int
    interrupted: bool = False
    evals: dict[int, float] = field(default_factory=dict)  # step -> validation loss
    summary: dict = field(default_factory=dict)
    complete: bool = False  # the run was already where it was asked to stop: nothing was done


def train(
    recipe: Recipe,
    run_dir: str | Path | None = None,
    fresh: bool = False,
    until_step: int | None = None,
    progress: bool = True,
    tensorboard: bool = True,
    init_from: str | Path | None = None,
    resume_optimizer: bool = False,
) -> TrainResult:
    """Train `recipe` in `run_dir` (default `<train.runs_dir>/<name>`), resuming its
    latest checkpoint unless `fresh`; stop after `until_step` if given (with a checkpoint).

    A new run can start from the weights of `init_from` (a run directory, a checkpoint, an
    imported or a Hugging Face folder) with a fresh optimizer, or with the source's
    optimizer state too (`resume_optimizer`, for a frugality checkpoint of the same shapes).
    """
    run_path = Path(run_dir) if run_dir is not None else Path(recipe.train.runs_dir) / recipe.name
    stop_at = _stop_at(recipe.train.steps, until_step)
    rundir.check_run_dir(run_path, fresh)  # (again once locked: nothing moves under another run)
    # Everything that can fail on bad input fails here, before the run directory is touched.
    layout = resolve_layout(recipe, resume_optimizer)
    recipe, device, world = layout.recipe, layout.device, layout.world
    passed = preflight(device, run_path.parent) if recipe.train.preflight else None  # before any write
    with rundir.locked(run_path, world, device):  # one writer per run directory, until the end
        if backend(device).host_memory and layout.checkpointing[0] == "none":
            keep_freed_memory()  # (a checkpointing mode asked for memory: freed memory goes back)
        data = open_training_data(layout.loads, progress, world.data_rank, world.data_size)
        if backend(device).traced:  # the next steps copied to the device while it runs this one
            data.stream = DevicePrefetchStream(cast(TrainStream, data.stream))  # (as opened)
        plan = rundir.plan_run(recipe, run_path, fresh)
        # every rank has read the directory as it was before the first rank writes to it (a
        # rank that planned late saw rank 0's new recipe.toml and no checkpoint: refused)
        distributed.barrier()
        done = _steps_done(plan, stop_at, until_step, recipe.train.steps)
        if done == stop_at:  # nothing to do: nothing is written, the run's results stay as they are
            summary = rundir.read_summary(run_path) if world.is_main else {}
            return TrainResult(run_path, done, done, summary=summary, complete=True)
        source = _weights_source(init_from, plan, resume_optimizer)
        state = build_state(layout, data)
        each = " on each rank" if world.distributed else ""
        state.choices += [*layout.notes, *([f"preflight: {passed} checks passed{each}"] if passed is not None else [])]
        checkpoints = CheckpointManager(run_path / "checkpoints", keep=recipe.train.keep_checkpoints)
        _restore(state, plan, source, checkpoints, resume_optimizer, stop_at)
        if world.is_main:
            rundir.open_run(plan, recipe, state.step if plan.resume_from is not None else None)
            if source is not None:  # e.g. the length an embedding model cuts texts to
                carry_description(source, run_path)
        distributed.barrier()
        summary = Summary(run_path) if world.is_main else None
        header = _header(state, plan, source, init_from, resume_optimizer) if world.is_main else []
        callbacks = _callbacks(state, run_path, checkpoints, summary, header, progress, tensorboard, stop_at)
        start = state.step
        _fit(state, callbacks, stop_at)
        evals, summarised = (summary.evals, summary.summary) if summary else ({}, {})
        return TrainResult(run_path, start, state.step, state.stop_requested, evals, summarised)


def _stop_at(total: int, until_step: int | None) -> int:
    if until_step is not None and not 0 < until_step <= total:
        raise UserError(f"--until-step {until_step}: must lie in 1..train.steps ({total})")
    return until_step or total


def _steps_done(plan: rundir.RunPlan, stop_at: int, until_step: int | None, total: int) -> int:
    """The steps the run directory holds: refused where they pass where this run stops."""
    done = step_of(plan.resume_from) if plan.resume_from is not None else 0
    if done > stop_at:
        raise UserError(
            f"--until-step {until_step}: {plan.path} is already at step {done}"
            if until_step
            else f"train.steps ({total}): {plan.path} is already at step {done}; raise train.steps to "
            "train on, or start over with --fresh"
        )
    return done


def _weights_source(init_from: str | Path | None, plan: rundir.RunPlan, resume_optimizer: bool) -> WeightsSource | None:
    """What a new run starts from (`--init-from`); a resumed run starts from its own checkpoint."""
    source = resolve_source(init_from) if init_from is not None and plan.resume_from is None else None
    if resume_optimizer and (source is None or not source.has_optimizer):
        raise UserError(
            "--resume-optimizer needs --init-from a frugality training checkpoint "
            "(one with optimizer state) and a new run"
        )
    return source


def _callbacks(
    state: TrainState,
    run_path: Path,
    checkpoints: CheckpointManager,
    summary: Summary | None,
    header: list[str],
    progress: bool,
    tensorboard: bool,
    stop_at: int,
) -> Callbacks:
    """The callbacks, in the order each hook calls them. One rank (the first) writes the log,
    shows progress and summarises; the others keep the rest."""
    main, recipe, world = state.world.is_main, state.recipe, state.world
    faults = os.environ.get(FAULT_ENV_VAR, "")
    return Callbacks(
        *(
            c
            for c in (
                Watchdog(run_path, recipe.train.step_timeout_s) if recipe.train.step_timeout_s else None,
                StopOnSignal(),
                CloseCompileSession(),  # publishes the compiled graphs before the summary names them
                Throughput(),  # tokens/s and MFU into each step's record
                Cost(run_path, main),  # elapsed time, dollars and energy into the records; the summary's cost
                DivergenceGuard(checkpoints),  # marks skipped steps (before the log), rolls back
                Memory() if main else None,  # the first step's memory, for the log and the summary
                RunLog(run_path, tensorboard) if main else None,
                Progress(header, progress, stop_at) if main else None,
                Checkpointing(checkpoints, stop_at),  # after evaluation: a checkpoint sees the step's whole result
                # the bubble and the collectives' time: its profiled steps begin after the checkpoints
                ParallelFigures(state) if world.tensor > 1 or world.pipeline > 1 else None,
                summary,  # last at the end: what the others published
                FaultInjector(faults, run_path, checkpoints) if "@" in faults else None,  # the reliability suite's
            )
            if c is not None
        )
    )


def _fit(state: TrainState, callbacks: Callbacks, stop_at: int) -> None:
    """The loop, with the blocks compiled (or fetched) once any checkpoint is loaded; the
    compiled graphs published and the callbacks closed however it ends; running out of
    memory is one line."""
    data = state.data
    try:
        with state.compiled.active(state.model):
            fit(state, callbacks, stop_at)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not out_of_memory(e):
            raise
        raise UserError(
            f"out of memory on {state.device} in step {state.step + 1} "
            f"({str(e).splitlines()[0][:160]}); lower data.micro_batch_size "
            f"({state.recipe.data.micro_batch_size}; the global batch is kept, by accumulation); "
            "checkpoints already written are kept"
        ) from None
    finally:
        if data is not None and isinstance(data.stream, DevicePrefetchStream):  # its threads first: on_exit may raise
            data.stream.close()
        callbacks.on_exit(state)


def out_of_memory(error: BaseException | None) -> bool:
    """An allocation that failed: CUDA's OutOfMemoryError, the CPU allocator's error, CUDA's
    and cuBLAS's own, here or as the cause of another error (a compiler's, wrapping it)."""
    texts = (
        "can't allocate memory",
        "not enough memory",
        "std::bad_alloc",
        "CUDA error: out of memory",
        "CUBLAS_STATUS_ALLOC_FAILED",
    )
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, torch.OutOfMemoryError) or any(text in str(error) for text in texts):
            return True
        error = error.__cause__ or error.__context__
    return False


def _restore(
    state: TrainState,
    plan: rundir.RunPlan,
    source: WeightsSource | None,
    checkpoints: CheckpointManager,
    resume_optimizer: bool,
    stop_at: int,
) -> None:
    """Load the run's latest checkpoint, or the --init-from weights; seed what follows.
    Shapes are checked first: a mismatch stops before anything is written."""
    seed = state.recipe.seed + 1  # seeded apart from initialisation so both orders of events reproduce
    if source is not None:
        if resume_optimizer:
            check_compatible(source, state.model)
            load_weights_and_moments(state, CheckpointManager(source.path.parent), source.path)
        else:
            fresh = load_weights(source, state.model)
            if fresh:
                state.choices.append(
                    f"--init-from has no {', '.join(sorted({n.rsplit('.', 1)[0] for n in fresh}))}: "
                    "trained from their initialisation"
                )
        rng.seed_everything(seed)
    elif plan.resume_from is not None:
        stored = stored_dtype(WeightsSource(plan.resume_from, "dcp"))
        if stored is not None and stored != state.policy.storage_dtype:  # DCP could not load it
            raise UserError(
                f"{plan.resume_from}: trained with {str(stored).removeprefix('torch.')} weights, but "
                f"this run resolves train.precision = {state.recipe.train.precision!r} to "
                f"{state.policy.name} here; resume with the run's precision (--set train.precision=...)"
            )
        extra = restore(state, checkpoints, plan.resume_from)
        saved = extra.get("precision", state.policy.name)
        if saved != state.policy.name:  # e.g. `auto` resolving otherwise on another machine
            raise UserError(
                f"{plan.resume_from}: trained with precision {saved}, but this run resolves "
                f"train.precision = {state.recipe.train.precision!r} to {state.policy.name} here; "
                f"resume with --set train.precision={saved}"
            )
    else:
        rng.seed_everything(seed)


def _header(
    state: TrainState,
    plan: rundir.RunPlan,
    source: WeightsSource | None,
    init_from: str | Path | None,
    resume_optimizer: bool,
) -> list[str]:
    """What the run prints before its first step: the machine, what was chosen for it, and
    the run (the last line)."""
    recipe, data = state.recipe, state.data
    assert data is not None  # (train's state has its data)
    lines = [f"hardware: {probe(state.device).describe()}", *state.choices]
    if plan.moved_aside is not None:
        lines.append(f"starting over: the previous run in {plan.path} was moved to {plan.moved_aside}")
    if plan.resume_from is not None:
        lines.append(f"resuming {plan.path} from step {state.step} ({plan.resume_from.name})")
        if init_from is not None:
            lines.append("--init-from applies to new runs only; resuming instead (--fresh to start over)")
        if plan.changes:
            lines.append(f"recipe changed since {plan.resume_from.name}: {', '.join(plan.changes)}")
    if plan.unused_edits:
        assert plan.edited_kept_as is not None  # named with them (plan_run)
        recipe_file = plan.path / rundir.RECIPE_FILE
        lines.append(
            f"{recipe_file} was edited by hand ({', '.join(plan.unused_edits)}, as 'file -> this run'); "
            f"this run uses its own recipe and keeps the edited file as {plan.edited_kept_as.name}; to train "
            f"with the edits, run: frugality train {plan.edited_kept_as}"
        )
    if source is not None:
        lines.append(f"initialised from {source.path}" + (" with its optimizer state" if resume_optimizer else ""))
    served = len(data.samples.train_ids)
    if served < recipe.data.global_batch_size:  # e.g. a Pythia recipe on the bundled corpus
        lines.append(
            f"data: {served:,} training samples, fewer than one step's {recipe.data.global_batch_size:,}: "
            "each step goes over them more than once; for this recipe, prepare a larger corpus "
            "(frugality data prepare FILES --out PREFIX) and --set data.dataset=PREFIX"
        )
    n_params = state.pipeline.parameters if state.pipeline else sum(p.numel() for p in state.model.parameters())
    lines.append(
        f"{recipe.name}: {recipe.model.family} {n_params / 1e6:.1f}M parameters, {state.policy.label} on "
        f"{state.device}, {recipe.train.steps} steps of {state.task.batch_shape(recipe)}, {data.description} "
        f"-> {plan.path}"
    )
    return lines
