"""Pipeline parallel with `torch.distributed.pipelining`: the decoder cut into stages by
blocks (the embedding with the first, the final norm and the output layer with the last),
each stage on its own rank of the mesh's "pipeline" dimension, the step's micro-batches
driven through them by a schedule (GPipe: all forwards, then all backwards; 1F1B: one
forward, one backward in the steady state, so at most `stages` micro-batches' activations
live at once; interleaved 1F1B: two stages a rank, a smaller bubble).

Every rank builds the whole model on the meta device and gives its stages the values the
whole model would have had under the recipe's seed (`frugality.models.materialize`), so
every layout starts from the same weights and no rank holds the whole model. A stage
module's parameter names are the whole model's ("layers.5.attn.qkv.weight"), so
checkpoints (DCP: each rank writes its stage's keys) load at any layout and `export hf`
consolidates them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from frugality.backends import backend
from frugality.config.recipe import ParallelConfig, Recipe
from frugality.errors import UserError
from frugality.models import Decoder, ModelConfig
from frugality.models.families import family, names
from frugality.models.layers import check_length

if TYPE_CHECKING:
    from torch.distributed.pipelining import ScheduleGPipe, ScheduleLoopedBFS
    from torch.distributed.pipelining.stage import _PipelineStageBase
    from torch.distributed.tensor import DTensor

    from frugality.distributed import World

# a new context around each forward and loss (the precision policy's autocast)
Autocast = Callable[[], contextlib.AbstractContextManager]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule == "interleaved-1f1b" else 1


def resolve_schedule(schedule: str) -> str:
    """`auto`: 1F1B, which holds the fewest micro-batches' activations of the schedules
    that run every compile level (blocks are compiled inside the stages)."""
    return "1f1b" if schedule == "auto" else schedule


def fit_microbatches(recipe: Recipe, data_ranks: int) -> tuple[Recipe, str | None]:
    """The recipe with a micro-batch small enough that a step has the micro-batches its
    schedule needs (at least one a stage; interleaved: a multiple of the stages), keeping
    the global batch, as `--nproc` keeps it; and the header's note (None when nothing
    changed). Where no micro-batch gives enough, a UserError saying what the global batch
    needs. An explicit `parallel.pipeline_microbatches` is left alone (`check_pipeline`)."""
    p, d = recipe.parallel, recipe.data
    if p.pipeline == 1 or p.pipeline_microbatches or d.global_batch_size % data_ranks:
        return recipe, None
    per_rank = d.global_batch_size // data_ranks
    interleaved = resolve_schedule(p.pipeline_schedule) == "interleaved-1f1b"

    def enough(micro: int) -> bool:
        n = per_rank // micro
        return per_rank % micro == 0 and n >= p.pipeline and (not interleaved or n % p.pipeline == 0)

    if enough(d.micro_batch_size):
        return recipe, None
    micro = next((m for m in range(d.micro_batch_size, 0, -1) if enough(m)), None)
    if micro is None:
        need = f"a multiple of {p.pipeline}" if interleaved else f"at least {p.pipeline}"
        raise UserError(
            f"parallel.pipeline {p.pipeline}: the global batch of {d.global_batch_size} over {data_ranks} "
            f"data-parallel rank(s) is {per_rank} sample(s) each, which no micro-batch makes into {need} "
            f"micro-batches (one a stage{', two stages a rank' if interleaved else ''}); raise "
            f"data.global_batch_size to {need} per data-parallel rank"
        )
    note = (
        f"data.micro_batch_size {d.micro_batch_size} -> {micro}: a step of parallel.pipeline {p.pipeline} needs "
        f"{'a multiple of' if interleaved else 'at least'} {p.pipeline} micro-batches; the global batch of "
        f"{d.global_batch_size} over {data_ranks} data-parallel rank(s) is {per_rank // micro} of {micro}"
    )
    return recipe.model_copy(update={"data": d.model_copy(update={"micro_batch_size": micro})}), note


def check_pipeline(model_config: ModelConfig, parallel: ParallelConfig, world_size: int, micro_batches: int) -> None:
    """Bad combinations, one line each, before anything starts. `micro_batches`: those of
    a step on each data-parallel rank."""
    pipeline = parallel.pipeline
    if pipeline == 1:
        return
    if world_size % (pipeline * parallel.tensor):
        raise UserError(
            f"parallel.pipeline {pipeline} x parallel.tensor {parallel.tensor}: must divide the number of "
            f"processes ({world_size})"
        )
    if not family(model_config).pipelined:
        raise UserError(
            f"parallel.pipeline: model family {model_config.family!r} is not cut into stages yet "
            f"({names(lambda f: f.pipelined)} are)"
        )
    if getattr(model_config, "tie_embeddings", False):
        raise UserError(
            "parallel.pipeline: tied embeddings would live on the first and the last stage; untie them "
            "(model.tie_embeddings = false) to pipeline this model"
        )
    schedule = resolve_schedule(parallel.pipeline_schedule)
    stages = pipeline * stages_per_rank(schedule)
    if model_config.num_layers % stages:
        raise UserError(
            f"parallel.pipeline {pipeline}: the model's {model_config.num_layers} layers do not divide into "
            f"{stages} stages" + (" (2 a rank: interleaved-1f1b)" if stages != pipeline else "")
        )
    if micro_batches < pipeline:
        raise UserError(
            f"parallel.pipeline {pipeline}: a step has {micro_batches} micro-batch(es) per data-parallel rank, "
            "fewer than the stages; raise parallel.pipeline_microbatches (or leave it unset: the micro-batch is "
            "then fitted to the stages)"
        )
    if schedule == "interleaved-1f1b" and micro_batches % pipeline:
        raise UserError(
            f"parallel.pipeline_schedule interleaved-1f1b: the step's {micro_batches} micro-batches must be a "
            f"multiple of parallel.pipeline ({pipeline})"
        )


class Stage(nn.Module):
    """Blocks [start, stop) of a decoder, with the embedding on the first stage and the
    final norm and output layer on the last; the whole model's parameter names."""

    def __init__(
        self, model: Decoder, start: int, stop: int, first: bool, last: bool, autocast: Autocast | None = None
    ) -> None:
        super().__init__()
        self.config = model.config
        self._autocast = autocast or contextlib.nullcontext  # the precision policy's, around forward and loss
        self.embed = model.embed if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(start, stop)})
        self.final_norm = model.final_norm if last else None
        self.output = model.output if last else None  # the loss function's: the logits never leave the stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            if self.embed is not None:
                check_length(x, self.config.max_seq_len)
                x = self.embed(x)
            for layer in self.layers.values():
                x = layer(x)
            return self.final_norm(x) if self.final_norm is not None else x

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        assert self.output is not None  # the schedule's loss function is the last stage's (`Pipeline`)
        with self._autocast():
            return self.output.loss(hidden, targets)


class StageGroup(nn.Module):
    """A rank's stages (two under interleaved 1F1B), as one module for the optimizer and
    the checkpoints: the parameter names are still the whole model's."""

    def __init__(self, stages: list[Stage], whole_model_shapes: dict[str, tuple] | None = None) -> None:
        super().__init__()
        self.config = stages[0].config
        self.whole_model_shapes = whole_model_shapes  # every stage's tensors (--init-from checks them all)
        self.embed = next((s.embed for s in stages if s.embed is not None), None)
        self.layers = nn.ModuleDict({k: v for s in stages for k, v in s.layers.items()})
        self.final_norm = next((s.final_norm for s in stages if s.final_norm is not None), None)
        self.output = next((s.output for s in stages if s.output is not None), None)


def cut(model: Decoder, rank: int, size: int, schedule: str, autocast: Autocast | None = None) -> list[Stage]:
    """This pipeline rank's stages of `model`: stage s holds an equal share of the blocks;
    rank r holds stages r, r + size, ... (the looped order interleaved schedules use)."""
    per = stages_per_rank(schedule)
    total = size * per
    n = len(model.layers) // total
    return [
        Stage(model, s * n, (s + 1) * n, first=s == 0, last=s == total - 1, autocast=autocast)
        for s in (rank + k * size for k in range(per))
    ]


class Pipeline:
    """The schedule that drives a rank's stages through each step's micro-batches, and the
    same stages' forward-only schedule for evaluation."""

    parameters: int  # the whole model's parameter counts, set by `frugality.runtime.state.build_state`
    non_embedding_parameters: int

    def __init__(
        self, stages: list[nn.Module], modules: list[Stage], mesh: DeviceMesh, schedule: str, micro_batches: int
    ) -> None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        self.group = mesh.get_group()
        self.size = mesh.size()
        self.modules = modules
        per = stages_per_rank(schedule)
        total = self.size * per
        self.rank = rank = mesh.get_local_rank()  # this rank's place along the pipeline
        self.stages: list[_PipelineStageBase] = [
            PipelineStage(m, rank + k * self.size, total, _device(m), group=self.group) for k, m in enumerate(stages)
        ]
        self.first = any(s.is_first for s in self.stages)
        self.last = any(s.is_last for s in self.stages)
        loss = next((m.loss for m in modules if m.output is not None), _no_loss)
        # the seconds a train step's schedule spends computing (the stages' forwards and
        # backwards, the loss), against its whole time: the rest is the bubble and the
        # waits for the neighbours' sends. Host clocks time only a host's compute (CPUs).
        # The data-parallel gradient reduction after the last backward counts as work too,
        # not as bubble (FSDP2's gathers run inside the forwards and backwards).
        self.compute_s = 0.0
        self.last_step: tuple[float, float] | None = None  # (schedule seconds, compute seconds)
        self._timed = backend(_device(modules[0])).on_host  # (a host clock times the stages' ops)
        train_loss = loss
        if self._timed:
            for s in self.stages:
                s.forward_one_chunk = self._timing(s.forward_one_chunk)
                s.backward_one_chunk = self._timing(s.backward_one_chunk)
                s.perform_reduce_grad = self._timing(s.perform_reduce_grad)
            train_loss = self._timing(loss)
        if schedule == "interleaved-1f1b":
            self.train = ScheduleInterleaved1F1B(self.stages, micro_batches, loss_fn=train_loss)
        else:
            kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            self.train = kind(self.stages[0], micro_batches, loss_fn=train_loss)
        self.schedule = schedule
        self.micro_batches = micro_batches
        self._runs, self._loss, self._rank, self._total = stages, loss, rank, total
        self.device = _device(modules[0])
        self._evaluations: dict[tuple, ScheduleGPipe | ScheduleLoopedBFS] = {}

    def step(self, batch: torch.Tensor) -> torch.Tensor:
        """Forward and backward of a step's micro-batches (rows of `batch`, inputs and next
        tokens); the gradients are those of the mean loss over them. Returns the mean loss,
        on every stage (the last stage's, sent to the others)."""
        losses: list[torch.Tensor] = []
        inputs, targets = batch[:, :-1], batch[:, 1:]
        args = (inputs,) if self.first else ()
        start, computed = time.perf_counter(), self.compute_s
        self.train.step(*args, target=targets if self.last else None, losses=losses, return_outputs=False)
        if self._timed:
            self.last_step = (time.perf_counter() - start, self.compute_s - computed)
        mean = (
            torch.stack([_plain(x) for x in losses]).mean().detach()
            if self.last
            else torch.zeros((), device=batch.device)
        )
        return self._from_last(mean)

    def evaluate(self, batch: torch.Tensor) -> torch.Tensor:
        """The mean loss of `batch`'s rows, forward only, on every stage."""
        losses: list[torch.Tensor] = []
        inputs, targets = batch[:, :-1], batch[:, 1:]
        args = (inputs,) if self.first else ()
        schedule = self._evaluation(tuple(batch.shape))
        schedule.eval(*args, target=targets if self.last else None, losses=losses, return_outputs=False)
        mean = (
            torch.stack([_plain(x) for x in losses]).mean().detach()
            if self.last
            else torch.zeros((), device=batch.device)
        )
        return self._from_last(mean)

    def _timing(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.compute_s += time.perf_counter() - start

        return timed

    def ideal_bubble(self) -> float:
        """The schedule's bubble with equal stages and free sends: (p - 1) / (v m + p - 1)
        of a step, for p ranks of v stages each and m micro-batches (Narayanan et al. 2021)."""
        p, v, m = self.size, stages_per_rank(self.schedule), self.micro_batches
        return (p - 1) / (v * m + p - 1)

    def _evaluation(self, shape: tuple):
        """A forward-only schedule of the same stage modules for batches of `shape`, each
        one micro-batch (a validation batch need not split as a step's batch does; a stage
        learns its shapes at its first use, so each shape has its own)."""
        if shape not in self._evaluations:
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleLoopedBFS

            stages: list[_PipelineStageBase] = [
                PipelineStage(m, self._rank + k * self.size, self._total, _device(m), group=self.group)
                for k, m in enumerate(self._runs)
            ]
            if len(stages) > 1:
                self._evaluations[shape] = ScheduleLoopedBFS(stages, 1, loss_fn=self._loss)
            else:
                self._evaluations[shape] = ScheduleGPipe(stages[0], 1, loss_fn=self._loss)
        return self._evaluations[shape]

    def _from_last(self, value: torch.Tensor) -> torch.Tensor:
        value = value.float().clone()
        dist.all_reduce(value, group=self.group)  # the other stages contribute zero
        return value

    def sum_over_stages(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the pipeline ranks (the squares of a gradient norm), on the
        stages' device for the collective (NCCL has no CPU tensors), back where it was."""
        moved = value.to(self.device)
        dist.all_reduce(moved, group=self.group)
        return moved.to(value.device)

    def evaluation_shapes(self) -> set:
        return set(self._evaluations)

    def describe(self) -> str:
        per = stages_per_rank(self.schedule)
        blocks = sum(len(m.layers) for m in self.modules)
        return (
            f"pipeline parallel over {self.size} ranks ({self.schedule}, {self.size * per} stages of "
            f"{blocks // per} blocks, {self.micro_batches} micro-batches a step)"
        )


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (under tensor parallel, a replicated DTensor)."""
    return cast("DTensor", loss).full_tensor() if hasattr(loss, "full_tensor") else loss


def _device(module: nn.Module) -> torch.device:
    p = next(module.parameters())
    return cast("DTensor", p).to_local().device if hasattr(p, "to_local") else p.device


def _no_loss(hidden, targets):  # a rank without the last stage never calls it
    raise RuntimeError("only the last stage computes the loss")


def build_pipeline(
    model: nn.Module,
    parallel: ParallelConfig,
    world: World,
    device: torch.device,
    micro_batches: int,
    autocast: Autocast | None = None,
    materialize: Callable[[list[Stage]], None] | None = None,
) -> tuple[Pipeline, StageGroup]:
    """This rank's stages of `model` (whole: built from the seed, or on the meta device and
    `materialize(stages)` giving the stages their values), each wrapped for data parallel
    over the ranks left over (DDP, or FSDP2 per block), and the schedule over them;
    returns (the Pipeline, the stages as one module for the optimizer and the checkpoints)."""
    from frugality.distributed import world_mesh

    mesh = world_mesh(parallel, world, device)
    schedule = resolve_schedule(parallel.pipeline_schedule)
    # `check_pipeline` admitted decoders only
    stages = cut(cast(Decoder, model), mesh["pipeline"].get_local_rank(), world.pipeline, schedule, autocast)
    if materialize is not None:
        materialize(stages)
    whole = {name: tuple(t.shape) for name, t in model.state_dict().items()}  # (a DTensor's: its global shape)
    runs = [_data_parallel(s, parallel, world, mesh) for s in stages]
    return Pipeline(runs, stages, mesh["pipeline"], schedule, micro_batches), StageGroup(stages, whole)


def _data_parallel(stage: Stage, parallel: ParallelConfig, world: World, mesh: DeviceMesh) -> nn.Module:
    """A stage for data parallel over the ranks left over: FSDP2 per block and at the
    stage's root on the mesh's data-parallel part (ddp there is FSDP2's replication, shard
    groups of one: DDP's reducer does not follow a schedule's interleaved backwards)."""
    if world.data_size == 1:
        return stage
    from torch.distributed.fsdp import fully_shard

    dp = mesh["replicate", "shard"]
    for block in stage.layers.values():
        fully_shard(block, mesh=dp, reshard_after_forward=parallel.reshard_after_forward)
    return cast(nn.Module, fully_shard(stage, mesh=dp))  # the stage itself, its class now also an FSDPModule
