"""A run's layout, worked out once: the device, the ranks and their parallel degrees, the
batch each rank takes and what its data stream loads, the precision policy, the task, and
the activation checkpointing mode; every refusal about a layout, one line each.

Three ways in, so that the rules can be asked without starting anything:
- `resolve_layout(recipe)`: what the process is (the device, torchrun's ranks, an SPMD
  client's devices), then `plan_layout`; what `frugality train` runs;
- `plan_layout(recipe, device, world)`: the rules, the policy resolved on the device and
  the memory weighed, for a world given (the launcher's dry run before ranks start, a table
  test, one process of `bench`). No process group is needed;
- `check_layout(recipe, device, world)`: the rules alone, for which a device of the kind is
  enough (`launch slurm`, from a login node without the job's GPUs; `bench scale`).

`runtime.state.build_state(layout, data)` builds what the layout says.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from frugality import distributed, xla
from frugality.backends import backend
from frugality.compile.levels import check_backend
from frugality.config.recipe import Recipe
from frugality.distributed import World
from frugality.distributed.pipeline import check_pipeline, fit_microbatches
from frugality.distributed.tensor_parallel import check_tensor_parallel
from frugality.errors import UserError
from frugality.kernels.dispatch import disabled as disabled_kernels
from frugality.metrics.prices import check_cost
from frugality.precision import PrecisionPolicy, resolve_policy
from frugality.runtime.device import check_local_processes, names_xla, resolve_device
from frugality.runtime.plan import fit_memory
from frugality.tasks import Task, get_task, task_for


@dataclass(frozen=True)
class Layout:
    recipe: Recipe  # the run's recipe, its micro-batch fitted to the ranks: what the run directory records
    loads: Recipe  # what this process's data stream loads (SPMD: every device's rows at once)
    device: torch.device
    world: World  # the ranks, with their tensor and pipeline degrees and SPMD devices
    policy: PrecisionPolicy
    precision_note: str  # the policy, and why (what auto chose on this device)
    task: Task  # the task as registered (its rules); `build_state` fits it to the data
    checkpointing: tuple[str, str]  # the activation checkpointing mode, and why
    notes: tuple[str, ...] = ()  # for the run's header: what was fitted to the layout, and why

    @property
    def model_parallel(self) -> bool:
        return self.world.tensor > 1 or self.world.pipeline > 1

    @property
    def accumulation(self) -> int:
        """Micro-batches a data-parallel rank takes a step."""
        d = self.recipe.data
        return d.global_batch_size // (d.micro_batch_size * self.world.data_size)


def resolve_layout(recipe: Recipe, resume_optimizer: bool = False) -> Layout:
    """This process's layout: its device (the local one under torchrun), its ranks (the
    process group opened), SPMD's devices; then `plan_layout`'s rules. Bad input fails here,
    before anything is written."""
    if recipe.parallel.spmd:
        _use_spmd(recipe)  # before the XLA client opens
    device = resolve_device(recipe.train.device, xla_ok=True)
    check_recipe(recipe, device)
    if backend(device).traced:
        _check_xla(recipe)
    world = distributed.init(device, recipe.parallel.timeout_s)  # world size 1 without torchrun
    device = distributed.local_device(device, world)
    if recipe.parallel.spmd:
        world = replace(world, devices=xla.device_count())
    return plan_layout(recipe, device, world, resume_optimizer)


def plan_layout(
    recipe: Recipe,
    device: torch.device,
    world: World = World(),
    resume_optimizer: bool = False,
    fit: bool = True,
) -> Layout:
    """The layout of `recipe` over `world` (its rank and size as torchrun gives them; the
    parallel degrees come from the recipe): `check_layout`'s rules and fitting, then the
    precision policy resolved on `device` and, with `fit`, the activation checkpointing mode
    the memory free now allows (`runtime.plan.fit_memory`). Each layout that does not run is
    a UserError of one line."""
    fitted = check_layout(recipe, device, world, resume_optimizer)
    recipe, world = fitted.recipe, fitted.world
    policy, precision_note = resolve_policy(recipe.train.precision, device)
    if policy.loss_scaling:
        check_loss_scaling(recipe, world)
    if fit:
        checkpointing = fit_memory(recipe, policy, world.world_size, device, world.tensor, world.pipeline)
    else:
        checkpointing = (recipe.train.activation_checkpointing, "not fitted to the memory (a dry run)")
    return Layout(recipe, fitted.loads, device, world, policy, precision_note, fitted.task, checkpointing, fitted.notes)


@dataclass(frozen=True)
class FittedBatch:
    recipe: Recipe  # the micro-batch fitted to the data-parallel ranks
    loads: Recipe
    world: World  # with its tensor and pipeline degrees
    task: Task
    notes: tuple[str, ...]


def check_layout(recipe: Recipe, device: torch.device, world: World, resume_optimizer: bool = False) -> FittedBatch:
    """The rules of a layout that need no device at hand (a device of the kind is enough:
    `launch slurm` checks a job for GPU nodes from a login node): tensor and pipeline
    degrees over the ranks, the batch fitted to them, what the stream loads; the task against
    the model, the cost catalogue; amp-fp16's loss scaling where the recipe names it (`auto`
    resolves on the device: `plan_layout`)."""
    p = recipe.parallel
    task_for(recipe)  # the task against the model family (and its own settings)
    check_cost(recipe.cost.instance, recipe.cost.catalogue)
    task = get_task(recipe.train.task)
    if p.tensor > 1:
        _check_tensor_parallel_run(recipe, device, task)
    check_tensor_parallel(recipe.model, p.tensor, p.sequence, world.world_size, recipe.data.seq_len)
    world = replace(world, tensor=p.tensor)
    if resume_optimizer and p.pipeline > 1:
        raise UserError(
            "--resume-optimizer with parallel.pipeline: not built yet; start the run in another layout "
            "(--until-step 1) and resume it under pipeline parallel"
        )
    if p.pipeline > 1 or p.pipeline_microbatches:
        recipe, world = _pipeline_layout(recipe, world, device, task)
    ranks = world.devices if p.spmd else world.data_size
    recipe, batch_note = recipe.for_data_parallel(ranks, task.min_micro_batch)
    batch = [batch_note] if batch_note else []
    if p.pipeline > 1:
        recipe, fitted = fit_microbatches(recipe, world.data_size)
        batch += [fitted] if fitted else []
        accumulated = recipe.data.global_batch_size // (recipe.data.micro_batch_size * world.data_size)
        check_pipeline(recipe.model, p, world.world_size, accumulated)
    loads = recipe
    if p.spmd:
        loads, line = _spmd_batches(recipe, ranks)
        batch.append(line)
    notes = ["; ".join(batch)] if batch else []  # the batch's fitting, one line
    if recipe.optim.warmup_steps > recipe.train.steps:  # (training.schedule cuts it)
        notes.append(
            f"optim.warmup_steps {recipe.optim.warmup_steps} -> {recipe.train.steps}: the warm-up is cut to train.steps"
        )
    if recipe.train.precision == "amp-fp16":
        check_loss_scaling(recipe, world)
    return FittedBatch(recipe, loads, world, task, tuple(notes))


def check_ranks(recipe: Recipe, nproc: int, resume_optimizer: bool = False) -> None:
    """Before a launcher starts `nproc` local ranks (`train --nproc`, `bench train --nproc`):
    refuse, in one line, more ranks than this machine has devices for (CPU: its cores), and
    any layout the ranks would refuse (`plan_layout`'s rules as a dry run over `nproc` ranks:
    the batch they share, tensor and pipeline degrees, precision; not the memory, which each
    rank weighs where it runs)."""
    device = resolve_device(recipe.train.device, xla_ok=True)
    check_local_processes(device, nproc)
    check_recipe(recipe, device)
    plan_layout(recipe, device, World(0, nproc), resume_optimizer, fit=False)


def check_recipe(recipe: Recipe, device: torch.device) -> None:
    """What must hold before anything else is done: the task against the model family,
    the precision on this device, the kernels asked off, the cost catalogue, the compile
    backend."""
    task_for(recipe)
    resolve_policy(recipe.train.precision, device)
    disabled_kernels()  # a misspelt FRUGALITY_DISABLE_KERNELS fails now, not mid-run
    check_cost(recipe.cost.instance, recipe.cost.catalogue)  # an unknown instance or a bad catalogue too
    if recipe.compile.level != "O0" and recipe.compile.backend != "inductor" and not backend(device).traced:
        check_backend(recipe.compile.backend)


def check_loss_scaling(recipe: Recipe, world: World) -> None:
    """amp-fp16's loss scaling runs in one process and under DDP, where every rank holds the
    whole gradients (and judges an overflow alike); one line for the layouts it does not run in yet."""
    p = recipe.parallel
    layout = (
        "tensor parallel"
        if world.tensor > 1
        else "pipeline parallel"
        if p.pipeline > 1
        else f"parallel.data {p.data}"
        if world.distributed and p.data != "ddp"
        else None
    )
    if layout is not None:
        chosen = " (what auto picks on this GPU)" if recipe.train.precision == "auto" else ""
        raise UserError(
            f"train.precision amp-fp16{chosen} (loss scaling) does not run with {layout} yet; it runs in one "
            "process and under parallel.data ddp"
        )


def _pipeline_layout(recipe: Recipe, world: World, device: torch.device, task: Task) -> tuple[Recipe, World]:
    """The world with its pipeline degree, and the recipe with the micro-batch that
    `parallel.pipeline_microbatches` asks for; what pipeline parallel does not run with
    yet, one line each."""
    p = recipe.parallel
    if p.pipeline > 1:
        if recipe.compile.level != "O0":
            raise UserError(
                f"parallel.pipeline: compile.level {recipe.compile.level} does not run with pipeline parallel yet "
                "(a block's fallback to eager would desynchronise the stages); use compile.level O0"
            )
        if world.world_size % (p.pipeline * p.tensor):
            raise UserError(
                f"parallel.pipeline {p.pipeline} x parallel.tensor {p.tensor}: must divide the number of "
                f"processes ({world.world_size}); pipeline parallel runs on torchrun (frugality train --nproc N)"
            )
        if not backend(device).model_parallel:
            raise UserError(f"parallel.pipeline: on {device.type} devices, pipeline parallel is not built")
        if not task.runs_model_parallel:
            raise UserError(f"parallel.pipeline: train.task {recipe.train.task} is not pipelined yet (causal_lm is)")
        world = replace(world, pipeline=p.pipeline)
    if p.pipeline_microbatches and p.pipeline == 1:
        raise UserError(
            "parallel.pipeline_microbatches: needs parallel.pipeline > 1 (data.micro_batch_size sets the rest)"
        )
    if p.pipeline_microbatches:
        if recipe.data.global_batch_size % world.data_size:
            raise UserError(
                f"data.global_batch_size ({recipe.data.global_batch_size}) cannot be shared by {world.data_size} "
                "data-parallel ranks"
            )
        per_rank = recipe.data.global_batch_size // max(1, world.data_size)
        if per_rank % p.pipeline_microbatches:
            raise UserError(
                f"parallel.pipeline_microbatches {p.pipeline_microbatches}: must divide the {per_rank} samples "
                "each data-parallel rank takes a step"
            )
        micro = per_rank // p.pipeline_microbatches
        recipe = recipe.model_copy(update={"data": recipe.data.model_copy(update={"micro_batch_size": micro})})
    return recipe, world


def _check_tensor_parallel_run(recipe: Recipe, device: torch.device, task: Task) -> None:
    """What tensor parallel does not run with yet, one line each."""
    if not backend(device).model_parallel:
        raise UserError(
            f"parallel.tensor: on {device.type} devices, tensor parallel is not built"
            " (on XLA, parallel.spmd shares data)"
        )
    if recipe.train.precision == "fp8":
        raise UserError(
            "parallel.tensor: train.precision fp8 does not run with tensor parallel yet (its linears are torchao's)"
        )
    if recipe.compile.level != "O0":
        raise UserError(
            f"parallel.tensor: compile.level {recipe.compile.level} does not run with tensor parallel yet "
            "(Inductor fails on its DTensor blocks here); use compile.level O0"
        )
    if not task.runs_model_parallel:
        raise UserError(
            f"parallel.tensor: train.task {recipe.train.task} does not run tensor parallel yet (causal_lm does)"
        )


def _check_xla(recipe: Recipe) -> None:
    """What an XLA device does not run yet, in one line, before anything is written."""
    task = get_task(recipe.train.task)
    if not task.runs_on_xla:
        raise UserError(f"train.task {task.name}: does not run on an xla device yet (causal_lm does; docs/xla.md)")
    if distributed.world_from_env().distributed:
        raise UserError(
            "an xla device trains in one process (torchrun over XLA devices is not built); parallel.spmd = true "
            "trains over all of one process's devices (docs/xla.md)"
        )


def _use_spmd(recipe: Recipe) -> None:
    name = recipe.train.device
    if not names_xla(name):
        where = "PJRT_DEVICE unset or torch_xla missing" if name == "auto" else name
        raise UserError(
            f"parallel.spmd: for an xla device (train.device = xla), not {where!r}; "
            "--set parallel.spmd=false trains without it"
        )
    if recipe.parallel.data == "hsdp":
        raise UserError('parallel.spmd: parallel.data "hsdp" is not built on XLA; choose ddp or fsdp')
    xla.use_spmd()


def _spmd_batches(recipe: Recipe, count: int) -> tuple[Recipe, str]:
    """One process loads the micro-batches of all `count` devices, which SPMD splits by rows:
    the recipe its data stream loads, and a line for the header. (The run's own recipe keeps
    the per-device micro-batch, so that a resume reads what the user wrote.)"""
    micro = recipe.data.micro_batch_size
    line = (
        f"data.micro_batch_size {micro} per XLA device x {count} devices (SPMD): micro-batches of "
        f"{micro * count} rows, split by rows"
    )
    return recipe.model_copy(update={"data": recipe.data.model_copy(update={"micro_batch_size": micro * count})}), line
