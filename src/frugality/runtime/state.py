"""The one builder of training state. Every command that trains or times training
(`train`, `compile`, `bench train`, `bench compile`) assembles its parts here, from the
run's layout (`frugality.runtime.layout`: device, ranks, batch, precision policy, task and
activation checkpointing, resolved and checked once), in this order, so that each sees the
same model:

1. the task, checked against the model and fitted to the run (`frugality.tasks.task_for`);
2. the model, built plain on the device from the recipe's seed, then cast or converted by
   the layout's precision policy;
3. backend kernels: the device's faster layers swapped in (`frugality.kernels.specialize`),
   and the blocks the activation checkpointing mode names made to recompute their
   activations in backward (`frugality.runtime.activation_checkpointing`);
4. the task's training module around the model, and parallel wrapping of that module from
   outside where torchrun started several processes (`frugality.distributed.wrap`: DDP or
   FSDP2);
5. the optimizer the policy calls for, over the model's parameters, and the compile
   session (`frugality.compile`), which the caller enters once any checkpoint is loaded.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from frugality.backends import backend
from frugality.compile.base import Session
from frugality.compile.factory import open_session
from frugality.config.recipe import Recipe
from frugality.distributed import World, describe, gather_with_grad, world_mesh, wrap
from frugality.distributed.pipeline import Pipeline, build_pipeline, resolve_schedule, stages_per_rank
from frugality.distributed.spmd import wrap_spmd
from frugality.distributed.tensor_parallel import apply_tensor_parallel, loss_context
from frugality.interop.weights import placed_like
from frugality.kernels.specialize import specialize
from frugality.metrics.flops import non_embedding_params
from frugality.models import build_model
from frugality.models.materialize import allocate, draw_parameters
from frugality.precision import PrecisionPolicy, apply_tf32
from frugality.precision.loss_scale import LossScaler
from frugality.runtime.activation_checkpointing import apply_activation_checkpointing, keep_output_workspace
from frugality.runtime.data import TrainingData
from frugality.runtime.layout import Layout
from frugality.runtime.optim import build_optimizer, fused_update
from frugality.tasks import Task, freeze_unused, task_for

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


@dataclass
class TrainState:
    """Everything a training loop touches; `step` counts optimizer steps done."""

    recipe: Recipe
    device: torch.device
    policy: PrecisionPolicy
    task: Task
    model: nn.Module  # the plain model (specialized, sharded in place under FSDP2): weights, names, checkpoints
    wrapped: nn.Module  # the task's training module around it, as the parallel strategy wraps it: what runs
    optimizer: torch.optim.Optimizer
    compiled: Session
    choices: list[str] = field(default_factory=list)  # what was picked for this machine, and why
    data: TrainingData | None = None
    world: World = World()
    step: int = 0
    stop_requested: bool = False  # set by a signal or a policy: stop after this step, saved
    recent_losses: deque[float] = field(default_factory=deque)  # applied steps' losses, for spike detection
    tokens_seen: int = 0  # every rank's tokens of every step so far (checkpointed: buckets make steps differ)
    pipeline: Pipeline | None = None  # pipeline parallel: the schedule that runs the steps and evaluations
    checkpointing: str = "none"  # activation checkpointing: none, selective or full
    loss_scaler: LossScaler | None = None  # amp-fp16: the dynamic loss scale

    @property
    def autocast(self):
        return self.policy.autocast_context(self.device)

    def loss_context(self):
        """Around a forward and its backward: the loss over vocabulary shards under tensor parallel."""
        return loss_context(self.world.tensor > 1)


def build_state(layout: Layout, data: TrainingData | None = None) -> TrainState:
    """The training state `layout` describes (see the module's docstring for the order);
    `data` from `frugality.runtime.data.open_training_data` where batches come from the
    recipe's dataset. The recipe's micro-batch and sequence length key the compiled graphs."""
    recipe, device, world, policy = layout.recipe, layout.device, layout.world, layout.policy
    gather = gather_with_grad if world.distributed and recipe.parallel.gather_negatives else None
    task = task_for(
        recipe,
        data.mask_id if data is not None else None,
        data.special_ids if data is not None else (),
        gather=gather,
        unpad=recipe.compile.level == "O0",
    )
    checkpointing_mode, why = layout.checkpointing
    tf32 = apply_tf32(device, recipe.train.tf32)  # before any product (the compile cache keys on it)
    every = recipe.train.selective_every
    label = f"selective-every-{every}" if checkpointing_mode == "selective" else checkpointing_mode  # (the graphs')
    compiled = open_session(recipe, device, policy, label)  # on XLA, its executable cache opens before any graph
    torch.manual_seed(recipe.seed)
    # tensor and pipeline parallel: the model built on the meta device, split, and only this
    # rank's part given its values (those the whole model would have had) on the device;
    # fp8 converts its layers as they are built, so it builds the whole model first
    in_parts = layout.model_parallel and policy.name != "fp8"  # (not on XLA: see runtime.layout)
    if backend(device).initialises_on_host:  # initialised on the host, as on a CPU, so a seed gives the same weights
        model = policy.prepare_model(build_model(recipe.model)).to(device)
    else:
        with torch.device("meta") if in_parts else device:
            model = policy.prepare_model(build_model(recipe.model))
    frozen = freeze_unused(task, model)  # before any wrapping: DDP must not wait for their gradients
    if world.tensor > 1:  # the layers become DTensor layers: the kernels, written for whole tensors, step aside
        mesh = world_mesh(recipe.parallel, world, device)["tensor"]
        choices = [apply_tensor_parallel(model, mesh, recipe.parallel.sequence), "kernels: none under tensor parallel"]
    else:
        choices = [] if in_parts else specialize(model, device, policy)
    # (before the pipeline's cut, FSDP2 and compile: they see the same blocks)
    # (selective under pipeline parallel: counted within each stage, two a rank under
    # interleaved 1F1B, as the plan counts them)
    stages = world.pipeline * stages_per_rank(resolve_schedule(recipe.parallel.pipeline_schedule))
    stage = recipe.model.num_layers // stages if world.pipeline > 1 else None
    recomputed = apply_activation_checkpointing(model, checkpointing_mode, every, stage)
    materialize = (
        (lambda parts: choices.extend(_materialize(recipe, device, policy, model, parts, checkpointing_mode)))
        if in_parts
        else None
    )
    pipeline, whole = None, None
    if world.pipeline > 1:  # the model becomes this rank's stages, driven by the schedule
        whole = model
        counts = (sum(p.numel() for p in whole.parameters()), non_embedding_params(whole))
        autocast = lambda: policy.autocast_context(device)  # noqa: E731 - a new context each forward
        pipeline, model = build_pipeline(
            model, recipe.parallel, world, device, layout.accumulation, autocast, materialize
        )
        pipeline.parameters, pipeline.non_embedding_parameters = counts
        wrapped = model
        choices += [pipeline.describe(), describe(recipe.parallel, world)]
    else:
        if materialize is not None:  # tensor parallel alone: this rank's shards of every layer
            materialize([model])
        wrapped = task.training_module(model)
    own = {id(p) for p in wrapped.parameters()} - {id(p) for p in model.parameters()}
    if own:  # the optimizer and the checkpoints see the model's parameters only
        raise RuntimeError(f"task {task.name}: its training module holds {len(own)} parameters of its own")
    if world.distributed and pipeline is None:
        wrapped = wrap(wrapped, getattr(model, "layers", []), recipe.parallel, world, device)
        choices.append(describe(recipe.parallel, world))
    elif recipe.parallel.spmd and backend(device).one_process:  # over one process's XLA devices
        wrapped, line = wrap_spmd(wrapped, model, recipe.parallel)
        choices.append(line)
    optimizer = build_optimizer(
        model, recipe.optim, policy, seed=recipe.seed, fused=fused_update(recipe, device), whole=whole
    )
    notes = [layout.precision_note, "layers: " + (", ".join(choices) or "plain PyTorch (no faster layer applies here)")]
    if recomputed:
        notes.append(
            f"activation checkpointing: {checkpointing_mode}, {recomputed} of {recipe.model.num_layers} blocks "
            f"recomputed in backward ({why})"
        )
    loss_scaler = None
    if policy.loss_scaling:
        loss_scaler = LossScaler(device, recipe.train.loss_scale, recipe.train.loss_scale_window)
        notes.append(
            f"loss scale: dynamic, from {recipe.train.loss_scale:g} (halved on an overflow, that step skipped; "
            f"doubled after {recipe.train.loss_scale_window} steps without one)"
        )
    if tf32 is not None:
        notes.append(tf32)
    if recipe.parallel.gather_negatives:
        notes.append(
            f"contrastive negatives gathered from all {world.world_size} ranks"
            if world.distributed
            else "parallel.gather_negatives: one process, nothing to gather"
        )
    notes += task.notes(recipe)
    if frozen:
        notes.append(f"not trained (task {task.name} does not use them): {_prefixes(frozen)}")
    return TrainState(
        recipe,
        device,
        policy,
        task,
        model,
        wrapped,
        optimizer,
        compiled,
        notes,
        data,
        world,
        recent_losses=deque(maxlen=recipe.train.loss_spike_window),
        pipeline=pipeline,
        checkpointing=checkpointing_mode,
        loss_scaler=loss_scaler,
    )


def _materialize(
    recipe: Recipe, device: torch.device, policy: PrecisionPolicy, whole: nn.Module, parts: list, checkpointing: str
) -> list[str]:
    """Give `parts` of `whole` (on the meta device; tensor-parallel layers hold DTensors)
    storage on `device` and the values `build_model` would have given them under the
    recipe's seed (drawn a layer at a time, each rank keeping its shards); then, without
    tensor parallel, the faster layers. Returns the choices made."""
    for part in parts:
        allocate(part, device)
    targets = dict(whole.named_parameters())

    def keep(name: str, value: torch.Tensor) -> None:
        target = targets.get(name)
        if target is None:
            return  # another rank's
        local = cast("DTensor", target).to_local() if hasattr(target, "to_local") else target
        if local.is_meta:
            return  # another rank's
        placed = placed_like(value, target)
        local.copy_(cast("DTensor", placed).to_local() if hasattr(placed, "to_local") else placed)

    torch.manual_seed(recipe.seed)
    draw_parameters(recipe.model, device, keep)
    if any(hasattr(p, "to_local") for p in whole.parameters()):
        return []
    choices = sorted({choice for part in parts for choice in specialize(part, device, policy)})
    for part in parts:  # (the fused output layer specialize swapped in: a pipeline's last stage)
        keep_output_workspace(part, checkpointing)
    return choices


def _prefixes(names: list[str]) -> str:
    """pooler.weight, pooler.bias, mlm.dense.weight -> pooler, mlm.dense"""
    return ", ".join(dict.fromkeys(name.rsplit(".", 1)[0] if "." in name else name for name in names))
