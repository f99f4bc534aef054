"""`frugality plan`: memory per rank for a recipe under a data-parallel strategy, before any
device is rented.

Parameters are counted on a model built on PyTorch's meta device (no memory, no compute),
and activations are what autograd saves for backward in a meta-device forward of one
micro-batch (views counted once with their base): eager PyTorch layers, no fused kernels,
attention counted as a flash-attention kernel keeps it (q, k,
v, the output and a log-sum-exp per row: what runs on CUDA GPUs and in torch's CPU kernel;
on the meta device SDPA would take its math path, which keeps the s x s scores). Per rank:
- weights, gradients and optimizer state: the precision policy's bytes per parameter, whole
  on every rank under DDP, 1/S of them under FSDP2 (S = all ranks) and HSDP (S = the shard
  group);
- in flight: DDP's gradient buckets (a second copy of the gradients, as
  `DistributedDataParallel` keeps them by default); FSDP2's gathered parameters and
  unsharded gradients of the root (embeddings, output layer) and of two blocks at a time
  (the running one and the prefetched one), or of every block without
  `parallel.reshard_after_forward`;
- activations of one micro-batch (amp-bf16: counted in bf16, the dtype autocast gives the
  products, since autocast does not run on the meta device), under the activation
  checkpointing mode asked for: each saved tensor is put down to the block whose forward
  saved it; a checkpointed block keeps its input instead of what it saved, and in backward
  one checkpointed block at a time holds its activations again (the largest is counted).
A plan fits when the total is at most 90% of the device memory (the rest for the runtime,
allocator fragmentation and workspaces, which depend on the device and are not counted).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from frugality.backends import backend
from frugality.config.recipe import Recipe
from frugality.distributed import all_min
from frugality.errors import UserError
from frugality.hardware import device_memory
from frugality.models import Decoder, build_model
from frugality.models.layers import OutputLayer
from frugality.precision import AUTO_POLICY, PrecisionPolicy, get_policy
from frugality.runtime.activation_checkpointing import checkpointed_blocks
from frugality.tasks import task_for

HEADROOM = 0.9  # of the device memory that the counted parts may take


@dataclass
class MemoryPlan:
    recipe: str
    strategy: str
    nproc: int
    shard_over: int  # ranks each parameter is split across (1: a full replica per rank)
    precision: str
    parameters: int
    micro_batch: int
    seq_len: int
    weights: int  # bytes per rank, each field
    gradients: int
    optimizer: int
    in_flight: int
    activations: int
    device_memory: int | None = None
    tensor: int = 1  # tensor-parallel degree
    pipeline: int = 1  # pipeline stages
    micro_batches_in_flight: int = 1  # whose activations a rank holds at once (a pipeline schedule's)
    checkpointing: str = "none"  # activation checkpointing: none, selective or full

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.in_flight + self.activations

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.total <= HEADROOM * self.device_memory

    def as_dict(self) -> dict:
        return asdict(self) | {"total": self.total, "fits": self.fits}


def plan_memory(
    recipe: Recipe,
    nproc: int,
    strategy: str,
    device_memory: int | None = None,
    policy: PrecisionPolicy | None = None,
    fused_output: bool = False,
    checkpointing: str = "none",
) -> MemoryPlan:
    """The plan under `policy` (as fitted to a device), by default the recipe's (`auto`:
    bf16-sr). `fused_output`: count the output layer's loss as frugality's fused layer keeps
    it (one tokens x vocab buffer in the compute dtype) rather than as eager PyTorch does.
    `checkpointing`: the activation checkpointing mode (none, selective, full)."""
    auto = recipe.train.precision == "auto"  # planned for hardware where bf16 products are native
    policy = policy or get_policy(AUTO_POLICY[True] if auto else recipe.train.precision)
    with torch.device("meta"):
        # the policy's cast (fp8's conversion aside: its linears keep fp32 weights, as counted)
        model = build_model(recipe.model)
        model = model if policy.name == "fp8" else policy.prepare_model(model)
    item = policy.storage_dtype.itemsize
    total = _numel(model)
    blocks = [_numel(block) for block in getattr(model, "layers", [])]
    root = total - sum(blocks)
    if strategy == "ddp" or nproc == 1:
        shard, in_flight = 1, total * item if nproc > 1 else 0  # the buckets
    else:
        shard = (recipe.parallel.shard_size or nproc) if strategy == "hsdp" else nproc
        largest = max(blocks, default=0)
        gathered = total if not recipe.parallel.reshard_after_forward else root + 2 * largest
        in_flight = (gathered + root + 2 * largest) * item  # gathered parameters + unsharded gradients
    per_rank = math.ceil(total / shard)
    moments = policy.state_bytes_per_param - 2 * item  # two Adam moments
    if policy.autocast:  # autocast does not run on the meta device: count its products' dtype
        model = model.to(policy.compute_dtype)
    profile = activation_profile(model, recipe, policy.compute_dtype if fused_output else None)
    activations = profile.bytes(checkpointing, recipe.train.selective_every)
    return MemoryPlan(
        recipe.name,
        strategy if nproc > 1 else "none",
        nproc,
        shard,
        policy.name,
        total,
        recipe.data.micro_batch_size,
        recipe.data.seq_len,
        per_rank * item,
        per_rank * item,
        per_rank * moments,
        in_flight,
        activations,
        device_memory,
        checkpointing=checkpointing,
    )


def plan_model_parallel(
    recipe: Recipe,
    nproc: int,
    strategy: str,
    tensor: int,
    pipeline: int,
    device_memory: int | None = None,
    policy: PrecisionPolicy | None = None,
    checkpointing: str = "none",
) -> MemoryPlan:
    """The plan per rank of the heaviest rank under tensor and pipeline parallel, data
    parallel (`strategy`) over the ranks left over:
    - parameters: the heaviest stage's (the first holds the embedding, the last the final
      norm and output layer; blocks shared out equally), split over the tensor ranks (the
      norms, a fraction of a percent, counted as split too), then over the data-parallel
      ranks as `strategy` shards them;
    - activations: a block's, measured as the difference of one- and two-block models, for
      the micro-batches the schedule keeps in flight on the first stage (1F1B: `pipeline`
      of them; GPipe: the step's; interleaved: `pipeline`), plus the output layer's on the
      last; under tensor parallel a block keeps 10 + 24/t of its 34 units of the residual
      stream without sequence parallel, 34/t with it (Korthikanti et al., 2022, table 2,
      flash attention's term left out); a checkpointed block keeps its input (the residual
      stream: split over the tensor ranks with sequence parallel), and one of them at a time
      holds its activations again in backward.
    `parallel.pipeline_schedule` and `parallel.sequence` come from the recipe."""
    from frugality.distributed.pipeline import resolve_schedule, stages_per_rank

    if nproc % (tensor * pipeline):
        raise UserError(f"--tensor {tensor} x --pipeline {pipeline}: must divide --nproc ({nproc})")
    if recipe.model.num_layers % pipeline:
        raise UserError(
            f"--pipeline {pipeline}: the model's {recipe.model.num_layers} layers do not divide into stages"
        )
    auto = recipe.train.precision == "auto"
    policy = policy or get_policy(AUTO_POLICY[True] if auto else recipe.train.precision)
    dp = nproc // (tensor * pipeline)
    with torch.device("meta"):
        # tensor and pipeline parallel split decoders only: their embedding, blocks and output layer
        model = cast(Decoder, policy.prepare_model(build_model(recipe.model)))
    item = policy.storage_dtype.itemsize
    block = _numel(model.layers[0])
    per_stage = recipe.model.num_layers // pipeline
    head = _numel(model) - block * recipe.model.num_layers  # embedding, final norm, output layer
    first = _numel(model.embed) + per_stage * block
    last = per_stage * block + head - _numel(model.embed)
    heaviest = max(first, last) if pipeline > 1 else _numel(model)
    local = math.ceil(heaviest / tensor)
    if strategy == "ddp" or dp == 1:
        shard, in_flight = 1, (local * item if dp > 1 else 0)
    else:
        shard = min(recipe.parallel.shard_size or dp, dp) if strategy == "hsdp" else dp
        in_flight = 3 * math.ceil(block / tensor) * item  # a block gathered, one prefetched, one's gradients
    per_rank = math.ceil(local / shard)
    moments = policy.state_bytes_per_param - 2 * item
    one = activation_profile(_with_layers(recipe, 1, policy), recipe, policy.compute_dtype)
    two = saved_activation_bytes(_with_layers(recipe, 2, policy), recipe, policy.compute_dtype)
    whole_one = one.bytes("none", 2)
    per_block, output = two - whole_one, 2 * whole_one - two
    kept = 34 / tensor if recipe.parallel.sequence else 10 + 24 / tensor
    per_block = per_block * kept / 34
    block_input = one.inputs[0] / (tensor if recipe.parallel.sequence else 1)
    schedule = resolve_schedule(recipe.parallel.pipeline_schedule)
    v = stages_per_rank(schedule) if pipeline > 1 else 1  # (a rank's blocks: v stages of per_stage // v)
    recomputed = v * len(checkpointed_blocks(per_stage // v, checkpointing, recipe.train.selective_every))
    stage = (per_stage - recomputed) * per_block + recomputed * block_input  # (selective: counted per stage)
    micro_batches = recipe.data.global_batch_size // (recipe.data.micro_batch_size * dp)
    in_flight_mb = 1 if pipeline == 1 else (micro_batches if schedule == "gpipe" else min(pipeline, micro_batches))
    activations = int(stage * in_flight_mb + (per_block if recomputed else 0) + output / tensor)
    layout = strategy if dp > 1 else "none"
    return MemoryPlan(
        recipe.name,
        layout,
        nproc,
        shard,
        policy.name,
        _numel(model),
        recipe.data.micro_batch_size,
        recipe.data.seq_len,
        per_rank * item,
        per_rank * item,
        per_rank * moments,
        in_flight,
        activations,
        device_memory,
        tensor,
        pipeline,
        in_flight_mb,
        checkpointing,
    )


def _with_layers(recipe: Recipe, layers: int, policy: PrecisionPolicy) -> nn.Module:
    with torch.device("meta"):
        model = policy.prepare_model(build_model(recipe.model.model_copy(update={"num_layers": layers})))
    return model.to(policy.compute_dtype) if policy.autocast else model


def saved_activation_bytes(model: nn.Module, recipe: Recipe, fused_output: torch.dtype | None = None) -> int:
    """Bytes autograd keeps for backward after the task's forward of one micro-batch, on the
    meta device (`model` built there); `fused_output`: the output layer's loss kept as the
    fused layer keeps it, one tokens x vocab buffer in that dtype."""
    return activation_profile(model, recipe, fused_output).bytes("none", 2)


@dataclass
class ActivationProfile:
    """What one micro-batch's forward saves for backward: before the blocks (`head`: the
    embedding's), in each block (`blocks`), after them (`tail`: the final norm's and output
    layer's), and each block's input (`inputs`: what a checkpointed block keeps)."""

    head: int
    blocks: list[int]
    inputs: list[int]
    tail: int

    def bytes(self, checkpointing: str, every: int) -> int:
        """Bytes held at most under an activation checkpointing mode: at the end of forward,
        the blocks not recomputed keep what they saved and the others their input; in
        backward (last block first), a recomputed block holds its activations again beside
        what the blocks before it keep, those after it and the tail freed."""
        recomputed = set(checkpointed_blocks(len(self.blocks), checkpointing, every))
        kept = [self.inputs[i] if i in recomputed else saved for i, saved in enumerate(self.blocks)]
        peak = self.head + sum(kept) + self.tail
        for i in sorted(recomputed):
            peak = max(peak, self.head + sum(kept[:i]) + self.inputs[i] + self.blocks[i])
        return peak


def activation_profile(model: nn.Module, recipe: Recipe, fused_output: torch.dtype | None = None) -> ActivationProfile:
    """`saved_activation_bytes`, put down to the block whose forward saved each tensor (the
    first, for a tensor saved twice), with each block's input."""
    saved: dict[int, tuple[torch.Tensor, int]] = {}  # base's id -> (base, block; -1 before them, -2 after)
    current = [-1]
    blocks = list(getattr(model, "layers", []))
    inputs = [0] * len(blocks)

    def keep(t: torch.Tensor):
        base = t._base if t._base is not None else t
        saved.setdefault(id(base), (base, current[0]))  # held, so that ids stay unique until counted
        return t

    def entering(i: int):
        def hook(module, args, kwargs):
            current[0] = i
            inputs[i] = sum(a.untyped_storage().nbytes() for a in args if isinstance(a, torch.Tensor))

        return hook

    def leaving(module, args, output):
        current[0] = -2

    hooks = [b.register_forward_pre_hook(entering(i), with_kwargs=True) for i, b in enumerate(blocks)]
    hooks += [b.register_forward_hook(leaving) for b in blocks]
    task = task_for(recipe)
    batch = task.example_batch(recipe, torch.device("meta"))
    sdpa, output_loss = F.scaled_dot_product_attention, OutputLayer.loss
    F.scaled_dot_product_attention = lambda q, k, v, **_: _FlashAttentionSaves.apply(q, k, v)
    if fused_output is not None:
        OutputLayer.loss = lambda self, hidden, targets: _FusedOutputSaves.apply(hidden, self.weight, fused_output)
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            task.training_module(model)(batch)
    finally:
        F.scaled_dot_product_attention, OutputLayer.loss = sdpa, output_loss
        for hook in hooks:
            hook.remove()
    parameters = {id(p) for p in model.parameters()}
    by_block = {i: 0 for i in range(-2, len(blocks))}
    for key, (t, block) in saved.items():
        if key not in parameters:
            by_block[block] += t.untyped_storage().nbytes()
    return ActivationProfile(by_block[-1], [by_block[i] for i in range(len(blocks))], inputs, by_block[-2])


class _FlashAttentionSaves(torch.autograd.Function):
    """Scaled dot-product attention's output shape, saving for backward what flash attention
    saves (meta tensors only: nothing is computed)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):  # never called: the plan runs forward only
        raise NotImplementedError


class _FusedOutputSaves(torch.autograd.Function):
    """The fused output-layer loss's scalar, saving what it keeps: the hidden states and one
    tokens x vocab buffer in the compute dtype (the logits' gradient, written in forward)."""

    @staticmethod
    def forward(ctx, hidden, weight, dtype):
        tokens = hidden.numel() // hidden.shape[-1]
        ctx.save_for_backward(hidden, hidden.new_empty((tokens, weight.shape[0]), dtype=dtype))
        return hidden.new_empty((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):  # never called: the plan runs forward only
        raise NotImplementedError


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def markdown_rows(plans: list[MemoryPlan]) -> str:
    gib = 2**30
    lines = [
        "| recipe | parameters | precision | strategy | ranks | sharded over | weights | gradients | optimizer "
        "| in flight | activation checkpointing | activations (1 micro-batch) | total per rank (GiB) "
        "| fits (device GiB) |",
        "|" + "---|" * 14,
    ]
    for p in plans:
        fits = "n/a" if p.device_memory is None else f"{'yes' if p.fits else 'no'} ({p.device_memory / gib:.1f})"
        lines.append(
            f"| {p.recipe} | {p.parameters / 1e6:,.0f}M | {p.precision} | {_layout(p)} | {p.nproc} | "
            f"{p.shard_over} | "
            f"{p.weights / gib:.2f} | {p.gradients / gib:.2f} | {p.optimizer / gib:.2f} | "
            f"{p.in_flight / gib:.2f} | {p.checkpointing} | {p.activations / gib:.2f} (b={p.micro_batch}, s={p.seq_len}"
            f"{f', x{p.micro_batches_in_flight} in flight' if p.pipeline > 1 else ''}) | "
            f"{p.total / gib:.2f} | {fits} |"
        )
    return "\n".join(lines)


def fit_memory(
    recipe: Recipe, policy: PrecisionPolicy, world_size: int, device: torch.device, tensor: int = 1, pipeline: int = 1
) -> tuple[str, str]:
    """The activation checkpointing mode a run takes, and why ("asked for", or what `auto`
    weighed). Its plan per rank (frugality's fused output loss
    counted as it runs; under tensor or pipeline parallel, the heaviest rank's) is held
    against the memory free on its device now (CPU ranks of one machine share its RAM, within
    any cgroup limit; the least among the ranks): `auto` takes the first of none, selective
    and full within HEADROOM of it, else the first within all of it; a run that
    fits under none of them (or not under the mode asked for) is refused in one line naming
    the micro-batch that would fit, rather than killed mid-step. `train.check_memory = false`
    checks nothing (`auto`: none)."""
    asked = recipe.train.activation_checkpointing
    if not backend(device).recomputes and asked not in ("auto", "none"):
        raise UserError(
            f"train.activation_checkpointing {asked}: not on XLA devices yet (torch_xla's own checkpoint is not "
            "wired in); set none or auto"
        )
    if not backend(device).plans_memory or not recipe.train.check_memory:
        return ("none", "auto: memory not checked here") if asked == "auto" else (asked, "asked for")

    def plan(mode: str, r: Recipe = recipe) -> MemoryPlan:
        if tensor > 1 or pipeline > 1:
            return plan_model_parallel(
                r, world_size, r.parallel.data, tensor, pipeline, policy=policy, checkpointing=mode
            )
        return plan_memory(r, world_size, r.parallel.data, policy=policy, fused_output=True, checkpointing=mode)

    free, _ = device_memory(device)
    if backend(device).host_memory:  # (the machine's ranks share it)
        free //= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    free = int(all_min(free, device))  # every rank the same answer: the least free memory among them
    gib = 2**30
    if asked != "auto":
        planned = plan(asked)
        if planned.total <= free:
            return asked, "asked for"
        tried = [(asked, planned)]
    else:
        # the first within HEADROOM of the free memory (the runtime, the allocator's
        # fragmentation and workspaces are not counted), else the first within all of it;
        # planned as needed (most runs: none alone)
        tried = []
        for mode in ("none", "selective", "full"):
            tried.append((mode, plan(mode)))
            if tried[-1][1].total <= HEADROOM * free:
                break
        for share in (HEADROOM, 1.0):
            for mode, planned in tried:
                if planned.total <= share * free:
                    weighed = ", ".join(f"{m} {p.total / gib:.2f}" for m, p in tried)
                    line = f"{HEADROOM:.0%} of it {HEADROOM * free / gib:.2f}"
                    return mode, f"auto: {weighed} GiB per rank planned; {free / gib:.2f} GiB free, {line}"
    mode, planned = tried[-1]
    where = (
        "of this machine's RAM" + (" per rank" if world_size > 1 else "")
        if backend(device).host_memory
        else f"on {device}"
    )
    micro = recipe.data.micro_batch_size
    fitting = next(
        (
            m
            for m in _smaller_divisors(micro)
            if plan(
                mode, recipe.model_copy(update={"data": recipe.data.model_copy(update={"micro_batch_size": m})})
            ).total
            <= free
        ),
        None,
    )
    lower = (
        f"set data.micro_batch_size {fitting} (the global batch is kept, by accumulation)"
        if fitting
        else "even a micro-batch of 1 does not fit: more ranks (fsdp, tensor or pipeline parallel) or a larger device"
    )
    under = f"activation checkpointing {mode}" + (" (auto: the most it recomputes)" if asked == "auto" else "")
    raise UserError(
        f"data.micro_batch_size {micro} x seq_len {recipe.data.seq_len} needs about {planned.total / gib:.1f} GiB "
        f"per rank under {under} (activations {planned.activations / gib:.1f} GiB; frugality plan), more than the "
        f"{free / gib:.1f} GiB free {where}; {lower}, or set train.check_memory = false to try anyway"
    )


def _smaller_divisors(micro: int) -> list[int]:
    """Smaller micro-batches to try, largest first: those that divide `micro` (the global
    batch it divides, it divides too)."""
    return [m for m in range(micro - 1, 0, -1) if micro % m == 0]


def _layout(p: MemoryPlan) -> str:
    parts = [p.strategy] if p.strategy != "none" or (p.tensor == 1 and p.pipeline == 1) else []
    parts += [f"TP {p.tensor}"] if p.tensor > 1 else []
    parts += [f"PP {p.pipeline}"] if p.pipeline > 1 else []
    return " x ".join(parts)
