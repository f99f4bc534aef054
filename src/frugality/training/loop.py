"""The training loop: steps of micro-batches, forward and backward through the task's loss,
the optimizer, evaluation, and stopping. Everything else (logs, progress, throughput and
memory, the NaN policy, checkpoints, signals, the summary) is a callback
(`frugality.training.callbacks`), called in the order given at each hook.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, cast

import torch

from frugality import xla
from frugality.backends import backend
from frugality.distributed import all_gather_rows, all_mean, all_sum, no_sync
from frugality.distributed.pipeline import Pipeline
from frugality.precision.bf16_adamw import BF16AdamW
from frugality.runtime.host_memory import give_back_freed_memory
from frugality.runtime.state import TrainState
from frugality.training.schedule import learning_rate

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.distributed.tensor import DTensor


@dataclass
class StepResult:
    step: int  # optimizer steps done, this one included
    loss: float | None  # mean over the step's micro-batches (None: an XLA step that did not read it)
    grad_norm: float | None  # before clipping
    lr: float
    seconds: float
    final: bool  # the last step of this session
    rejected: str | None = None  # why the update was not applied (a non-finite value, a spike)
    record: dict = field(default_factory=dict)  # what callbacks measured, for the log
    tokens: int = 0  # the tokens every rank's forwards processed in this step, as the task counts them
    logs: dict = field(default_factory=dict)  # other records for the log, by kind ("memory": {...})
    rolled_back_to: int | None = None  # set by a policy that restored a checkpoint (the loop goes on from its step)
    overflow: str | None = None  # amp-fp16: the loss scale overflowed and the step was skipped (not a bad step)


@dataclass
class RunEnd:
    """The end of a session, as callbacks see it: the sections of the summary they publish
    (throughput's peak, memory, cost), for the summary to write."""

    summary: dict = field(default_factory=dict)


@dataclass
class EvalResult:
    step: int
    loss: float  # mean validation loss over every rank's batches
    record: dict = field(default_factory=dict)  # what callbacks measured, for the log


def fit(state: TrainState, callbacks, stop_at: int) -> None:
    """Train from `state.step` to `stop_at` (or until a callback asks to stop), evaluating
    at step 0 of a new run, every `train.eval_interval` steps and at the last step."""
    recipe = state.recipe
    assert state.data is not None  # a training run's state has its data (bench's, which only time steps, not)
    callbacks.on_train_start(state)
    if state.step == 0:
        evaluate(state, callbacks)
    while state.step < stop_at:
        t0 = time.perf_counter()  # the step's time includes fetching its batches
        lr = learning_rate(
            state.step, recipe.train.steps, recipe.optim.lr, recipe.optim.min_lr, recipe.optim.warmup_steps
        )
        for group in state.optimizer.param_groups:
            group["lr"] = lr
        batches = state.data.stream.next_step()
        phase = "train" + state.task.shape_key(batches[0])  # a length bucket's first step is its warm-up
        # XLA: the steps whose loss comes to the host (and is judged): logged ones, saved ones, the last
        number = state.step + 1
        read = number % recipe.train.log_interval == 0 or number % recipe.train.save_interval == 0 or number == stop_at
        loss, norm, rejected = _run(
            state, callbacks, phase, state.step + 1, partial(train_step, state, batches, read=read)
        )
        state.step += 1
        tokens = step_tokens(state, batches)
        state.tokens_seen += tokens
        result = StepResult(
            state.step, loss, norm, lr, time.perf_counter() - t0, state.step == stop_at, rejected, tokens=tokens
        )
        if state.loss_scaler is not None:
            result.record["loss_scale"] = state.loss_scaler.scale_before  # the scale this step ran at
            if state.loss_scaler.overflowed:  # logged at every step it happens (the train record: at log steps)
                result.overflow = result.record["overflow"] = state.loss_scaler.describe_overflow()
                result.logs["overflow"] = {"loss_scale": state.loss_scaler.scale_before, "message": result.overflow}
        callbacks.on_step_end(state, result)
        if result.rolled_back_to is not None:  # a policy restored the last checkpoint: go on from its step
            continue
        if state.step % recipe.train.eval_interval == 0 or state.step == recipe.train.steps:
            evaluate(state, callbacks)
        callbacks.on_step_done(state)  # after evaluation: checkpoints see the step's whole result
        if state.stop_requested:  # asked during the step (or the evaluation before it): stop, saved
            break
    callbacks.on_train_end(state, RunEnd())


def step_tokens(state: TrainState, batches: list) -> int:
    """Tokens processed by every rank in a step: the same on each rank when batches have one
    shape; summed over the ranks when length buckets make them differ."""
    mine = sum(state.task.tokens(b) for b in batches)
    if not state.world.distributed:
        return mine
    if not state.task.shape_key(batches[0]):
        return mine * state.world.data_size
    # the tensor- and pipeline-parallel ranks of a data-parallel rank share its batches
    return int(all_sum([mine], state.device)[0]) // (state.world.world_size // state.world.data_size)


def train_step(
    state: TrainState, micro_batches: list[torch.Tensor], read: bool = True
) -> tuple[float | None, float | None, str | None]:
    """One optimizer step over micro-batches of the task's batches: forward and backward
    each through the task's training module (loss divided by their count), clip the global
    gradient norm, update — unless the loss or the gradients are not finite, or the loss
    spikes (`train.loss_spike`): then nothing is applied (every rank decides alike: the loss
    is the ranks' mean, the norm global). Returns (mean loss, gradient norm before
    clipping, why the update was not applied or None).

    On an XLA device the step is traced into graphs that never wait for the host: a cut
    after each micro-batch's backward and after the update, the update always applied, and
    the loss and norm read (for the log and the bad-step policy, which then rolls back) only
    where `read` says: at logging steps (`train.log_interval`) and the last one. Elsewhere
    (None, None, None) comes back."""
    if backend(state.device).traced:
        return _train_step_xla(state, micro_batches, read)
    if state.pipeline is not None:
        return _train_step_pipeline(state, state.pipeline, micro_batches)
    wrapped = state.wrapped
    wrapped.train()
    total = torch.zeros((), device=state.device)
    for i, batch in enumerate(micro_batches):
        # several ranks: gradients are reduced with the last micro-batch's backward only
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else no_sync(wrapped), state.loss_context():
            with state.autocast:
                loss = wrapped(batch.to(state.device, non_blocking=True))
            share = loss / len(micro_batches)
            (state.loss_scaler.scale_loss(share) if state.loss_scaler is not None else share).backward()
        total += _plain(loss.detach())
    return _clip_and_update(state, (total / len(micro_batches)).item())


def _clip_and_update(
    state: TrainState, mean: float, over_stages: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[float, float, str | None]:
    """After a step's backward: the global gradient norm (`over_stages`: summing the other
    pipeline stages' squares), then the update with clipping unless the loss (every rank's
    mean of `mean`) or the gradients are bad; returns (loss, norm, why not applied). amp-fp16:
    the gradients are unscaled first, and an overflow skips the step without being a bad one
    (`frugality.precision.loss_scale`)."""
    model, optimizer, scaler = state.model, state.optimizer, state.loss_scaler
    if scaler is not None:
        scaler.unscale(optimizer)
    max_norm = state.recipe.optim.grad_clip if state.recipe.optim.grad_clip > 0 else float("inf")
    clip = None
    if isinstance(optimizer, BF16AdamW):  # clipping folded into its update
        norm = optimizer.clip_grad_norm_(max_norm, sum_squares=over_stages)
    else:  # the norm first, so that non-finite gradients are seen before clipping scales them all
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        clip = torch.nn.utils.get_total_norm(grads, foreach=True)
        norm = cast("DTensor", clip).full_tensor() if hasattr(clip, "full_tensor") else clip  # FSDP2: a DTensor
        if over_stages is not None:
            norm = clip = over_stages(norm.float().square()).sqrt()
    loss, norm = all_mean(mean, state.device), norm.item()
    overflow = scaler is not None and scaler.is_overflow(loss, norm)
    rejected = None if overflow else _first_nonfinite(model, loss, norm) or _spike(state, loss)
    if rejected is None and not overflow:
        if clip is not None:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, clip, foreach=True)
        optimizer.step()
        state.recent_losses.append(loss)
    if scaler is not None:
        scaler.update(overflow, applied=rejected is None and not overflow)
    optimizer.zero_grad(set_to_none=True)  # (BF16AdamW: drops a pending clip scale too)
    if state.checkpointing != "none" and backend(state.device).host_memory:
        give_back_freed_memory()  # (memory asked for over time: runtime.host_memory)
    return loss, norm, rejected


def _train_step_pipeline(state: TrainState, pipeline: Pipeline, micro_batches: list) -> tuple[float, float, str | None]:
    """A step through the pipeline's stages: its micro-batches are the schedule's; the loss
    comes from the last stage, the gradient norm is summed over every stage's parameters."""
    state.model.train()
    batch = torch.cat([b.to(state.device) for b in micro_batches])
    with state.loss_context():  # the schedule runs the forwards and the backwards
        mean = pipeline.step(batch)
    return _clip_and_update(state, mean.item(), pipeline.sum_over_stages)


def _train_step_xla(
    state: TrainState, micro_batches: list, read: bool
) -> tuple[float | None, float | None, str | None]:
    model, optimizer, wrapped = state.model, state.optimizer, state.wrapped
    wrapped.train()
    total = torch.zeros((), device=state.device)
    for batch in micro_batches:
        with state.autocast:
            loss = wrapped(batch.to(state.device))
        (loss / len(micro_batches)).backward()
        total += loss.detach()
        xla.sync()  # one graph per micro-batch: forward and backward
    max_norm = state.recipe.optim.grad_clip if state.recipe.optim.grad_clip > 0 else float("inf")
    if isinstance(optimizer, BF16AdamW):  # clipping folded into its update
        norm = optimizer.clip_grad_norm_(max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mean = total / len(micro_batches)
    xla.sync()  # the update's graph; the loss and norm are its outputs
    if not read:
        return None, None, None
    loss, norm = mean.item(), norm.item()
    rejected = None
    if not (math.isfinite(loss) and math.isfinite(norm)):
        rejected = f"the loss ({loss}) or the gradient norm ({norm}) is not finite"
    else:
        rejected = _spike(state, loss)
        if rejected is None:
            state.recent_losses.append(loss)
    return loss, norm, rejected


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (under tensor parallel, a replicated DTensor)."""
    return cast("DTensor", t).full_tensor() if hasattr(t, "full_tensor") else t


def _first_nonfinite(model: torch.nn.Module, loss: float, norm: float) -> str | None:
    """None when the step may be applied; else the loss, or the first parameter (in the
    model's order) whose gradient holds a NaN or infinity on this rank."""
    if not math.isfinite(loss):
        return f"the loss ({loss}) is not finite"
    if math.isfinite(norm):
        return None
    for name, p in model.named_parameters():
        grad = cast("DTensor", p.grad).to_local() if hasattr(p.grad, "to_local") else p.grad
        if grad is not None and not torch.isfinite(grad).all():
            return f"the gradient of {name} is not finite"
    return f"the gradient norm ({norm}; the gradients of this rank are finite) is not finite"


def _spike(state: TrainState, loss: float) -> str | None:
    """A loss above `train.loss_spike` times the median of the recent applied steps' (once
    a quarter of the window, at least 4 steps, has been seen)."""
    factor, recent = state.recipe.train.loss_spike, state.recent_losses
    if factor is None:
        return None
    assert recent.maxlen is not None  # build_state bounds it: train.loss_spike_window
    if len(recent) < max(4, recent.maxlen // 4):
        return None
    median = statistics.median(recent)
    if loss <= factor * median:
        return None
    return (
        f"the loss {loss:.4g} is {loss / median:.1f}x the median {median:.4g} of the last {len(recent)} "
        f"steps (train.loss_spike = {factor})"
    )


@torch.no_grad()
def validation_loss(state: TrainState) -> tuple[float, dict]:
    """The mean loss over every rank's counted validation batches, each batch's mean weighted
    by what it averages over (rows, masked positions, pairs): the same samples give the same
    loss whatever the micro-batch and the ranks (batches may be short); and the task's
    figures from the same forwards (contrastive: recall@k and MRR over every rank's
    held-out pairs)."""
    state.wrapped.eval()
    if state.pipeline is not None:
        return _validation_loss_pipeline(state, state.pipeline)
    assert state.data is not None  # (see fit)
    done = []
    on_xla = backend(state.device).traced
    for batch in state.data.val_batches:
        with state.autocast, state.loss_context():
            done.append(state.wrapped(batch.to(state.device), evaluate=True))
        if on_xla:
            xla.sync()  # a graph per batch; the losses are read once, below
    n = state.data.val_counted
    if on_xla:  # one transfer of every batch's loss, not one per batch
        losses = torch.stack([d.loss.float() for d in done[:n]]).cpu().tolist() if n else []
        for d, value in zip(done, losses, strict=False):  # (only the counted ones were read)
            d.loss = torch.tensor(value)
    metrics = state.task.metrics([d.outputs for d in done], n, all_gather_rows)
    counted = done[:n]
    total, count = all_sum(
        [sum(d.loss.item() * d.weight for d in counted if d.weight), sum(d.weight for d in counted)], state.device
    )
    return total / count, metrics


def _validation_loss_pipeline(state: TrainState, pipeline: Pipeline) -> tuple[float, dict]:
    """The validation batches through the stages, forward only; each batch's mean loss
    weighted by its rows (every rank holds it after the pipeline's broadcast)."""
    assert state.data is not None  # (see fit)
    n = state.data.val_counted
    if state.world.data_size > 1:
        _align_evaluation_shapes(state, state.data.val_batches, pipeline)
    total = count = 0.0
    for i, batch in enumerate(state.data.val_batches):
        with state.loss_context():
            loss = pipeline.evaluate(batch.to(state.device)).item()
        if i < n:
            total, count = total + loss * batch.shape[0], count + batch.shape[0]
    total, count = all_sum([total, count], state.device)
    return total / count, {}


def _align_evaluation_shapes(state: TrainState, val_batches: list, pipeline: Pipeline) -> None:
    """A stage learns a batch shape by running it once (FSDP2 gathering parameters in that
    forward), and the short last validation batch is one rank's: before the first
    evaluation, every rank runs each shape any rank has, in the same order, uncounted."""
    mine = sorted({batch.shape[0] for batch in val_batches})
    every = [None] * state.world.world_size
    torch.distributed.all_gather_object(every, mine)
    every_rows = cast(list[list[int]], every)  # filled in by all_gather_object
    rows = sorted({r for ranks in every_rows for r in ranks} - {s[0] for s in pipeline.evaluation_shapes()})
    first = val_batches[0].to(state.device)
    for r in rows:  # a batch of r rows from this rank's first (repeated where it is the short one)
        batch = first.repeat(-(-r // first.shape[0]), 1)[:r]
        with state.loss_context():
            pipeline.evaluate(batch)


def evaluate(state: TrainState, callbacks) -> float:
    loss, metrics = _run(state, callbacks, "eval", state.step, lambda: validation_loss(state))
    callbacks.on_eval(state, EvalResult(state.step, loss, dict(metrics)))
    return loss


def _run(state: TrainState, callbacks, phase: str, number: int, fn):
    """`fn` through the compile session; callbacks hear once when a phase is compiled."""
    first = state.compiled.enabled and phase not in state.compiled.warmed
    out = state.compiled.run(phase, number, fn, reset=lambda: state.optimizer.zero_grad(set_to_none=True))
    if first:
        callbacks.on_compiled(state, phase)
    return out
