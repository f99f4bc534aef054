"""The training loop: one recipe, one run directory, resumable at any checkpoint.

`train(recipe)` checks everything it can (tokenizer, dataset, batch shapes) before it
writes anything, then trains with AdamW under the warm-up + cosine schedule, evaluates
on held-out data, logs every step to TensorBoard and `metrics.jsonl`, and checkpoints
through DCP. With a fixed seed a CPU run is reproducible bit for bit, across a stop and
resume too: model, optimizer, data position and RNG states all live in the checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from frugality.checkpoint import CheckpointManager, step_of
from frugality.checkpoint.weights import check_compatible, load_weights, resolve_source
from frugality.compile.session import CompileSession
from frugality.config.recipe import Recipe
from frugality.cache import cache_dir
from frugality.data.bundled import BUNDLED_PREFIX, bundled_dataset
from frugality.data.indexed import IndexedDataset
from frugality.data.loader import PackedSamples, TrainStream, validation_batches
from frugality.data.tokenizer import load_tokenizer
from frugality.errors import UserError
from frugality.metrics.flops import non_embedding_params, training_flops_per_token
from frugality.metrics.logger import RunLogger
from frugality.metrics.memory import peak_memory_bytes, training_state_bytes
from frugality.hardware import probe
from frugality.metrics.peak import mfu, peak_flops
from frugality.models import DECODERS
from frugality.precision import resolve_policy
from frugality.training.build import build_training_model
from frugality.training import run_dir as rundir
from frugality.training.host_memory import keep_freed_memory
from frugality.training.optim import build_optimizer
from frugality.training.schedule import learning_rate


@dataclass
class TrainResult:
    run_dir: Path
    start_step: int
    final_step: int
    interrupted: bool = False
    evals: dict[int, float] = field(default_factory=dict)  # step -> validation loss
    summary: dict = field(default_factory=dict)


def resolve_device(name: str) -> torch.device:
    """The device `train.device` names, ready to train on: on CPUs, the host allocator
    keeps freed blocks for the next step (see frugality.training.host_memory)."""
    if name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(name)
        except RuntimeError:
            raise UserError(f"train.device: {name!r} is not a device (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"train.device: {name!r} requested but this torch build sees no CUDA device")
    if device.type == "cpu":
        keep_freed_memory()
    return device


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
    total = recipe.train.steps
    if until_step is not None and not 0 < until_step <= total:
        raise UserError(f"--until-step {until_step}: must lie in 1..train.steps ({total})")
    stop_at = until_step or total

    # Everything that can fail on bad input fails here, before the run directory is touched.
    if recipe.model.family not in DECODERS:
        raise UserError(f"model.family {recipe.model.family!r}: frugality train trains decoders "
                        f"({', '.join(DECODERS)}); {recipe.model.family} models can be imported, "
                        "exported and used for embeddings")
    device = resolve_device(recipe.train.device)
    policy, precision_note = resolve_policy(recipe.train.precision, device)
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    if tokenizer.vocab_size > recipe.model.vocab_size:
        raise UserError(
            f"tokenizer {recipe.data.tokenizer!r} has {tokenizer.vocab_size} tokens, more than "
            f"model.vocab_size ({recipe.model.vocab_size})"
        )
    dataset = _open_dataset(recipe, tokenizer, progress)
    samples = PackedSamples(dataset, recipe.data.seq_len, recipe.data.val_fraction, recipe.seed)
    stream = TrainStream(samples, recipe.data.global_batch_size, recipe.data.micro_batch_size)
    val_batches = validation_batches(samples, recipe.train.eval_batches, recipe.data.micro_batch_size)
    # A dataset tokenized for another vocabulary shows in its first tokens; scanning them
    # all would take minutes on a large corpus.
    if int(dataset.tokens[: 1 << 24].max(initial=0)) >= recipe.model.vocab_size:
        raise UserError(
            f"dataset {dataset.prefix}: holds token ids >= model.vocab_size "
            f"({recipe.model.vocab_size}); was it tokenized with another tokenizer?"
        )
    plan = rundir.plan_run(recipe, run_path, fresh)
    source = resolve_source(init_from) if init_from is not None and plan.resume_from is None else None
    if resume_optimizer and (source is None or not source.has_optimizer):
        raise UserError("--resume-optimizer needs --init-from a frugality training checkpoint "
                        "(one with optimizer state) and a new run")

    torch.manual_seed(recipe.seed)
    model, kernel_choices = build_training_model(recipe.model, policy, device)
    optimizer = build_optimizer(model, recipe.optim, policy, seed=recipe.seed,
                                fused=recipe.train.fused_optimizer)
    checkpoints = CheckpointManager(run_path / "checkpoints", keep=recipe.train.keep_checkpoints)
    start = 0
    if source is not None:  # shapes are checked first: a mismatch stops before anything is written
        if resume_optimizer:
            check_compatible(source, model)
            CheckpointManager(source.path.parent).load(source.path, model, optimizer)
        else:
            load_weights(source, model)
        _seed_everything(recipe.seed + 1)
    elif plan.resume_from is not None:
        extra = checkpoints.load(plan.resume_from, model, optimizer)
        start = step_of(plan.resume_from)
        stream.load_state_dict(extra["data"])
        _set_rng_state(extra["rng"])
        if stop_at < start:
            raise UserError(f"--until-step {stop_at}: {run_path} is already at step {start}")
    else:
        # Seeded separately from initialisation so both orders of events reproduce.
        _seed_everything(recipe.seed + 1)
    rundir.open_run(plan, recipe, start if plan.resume_from is not None else None)

    compiled = CompileSession.for_recipe(recipe, device, policy)
    compiled.start(model)
    logger = RunLogger(run_path, tensorboard=tensorboard)
    try:
        return _train_loop(recipe, model, optimizer, policy, device, stream, val_batches, checkpoints,
                           logger, compiled, TrainResult(run_path, start, start), stop_at, progress,
                           banner=_banner(recipe, model, device, samples, dataset, plan, source,
                                          init_from, resume_optimizer, start, policy,
                                          [precision_note, "layers: " + ", ".join(kernel_choices)]))
    finally:
        compiled.close()  # publishes what was compiled, even when the run stopped on an error
        logger.close()
        compiled.cleanup()


def _banner(recipe, model, device, samples, dataset, plan, source, init_from, resume_optimizer,
            start, policy, choices) -> list[str]:
    """What the run prints before its first step: the machine, what was chosen for it, and
    the run (the last line)."""
    run_path, total = plan.path, recipe.train.steps
    lines = [f"hardware: {probe(device).describe()}", *choices]
    if plan.moved_aside is not None:
        lines.append(f"starting over: the previous run in {run_path} was moved to {plan.moved_aside}")
    if plan.resume_from is not None:
        lines.append(f"resuming {run_path} from step {start} ({plan.resume_from.name})")
        if init_from is not None:
            lines.append("--init-from applies to new runs only; resuming instead (--fresh to start over)")
    if source is not None:
        lines.append(f"initialised from {source.path}"
                     + (" with its optimizer state" if resume_optimizer else ""))
    n_params = sum(p.numel() for p in model.parameters())
    lines.append(
        f"{recipe.name}: {recipe.model.family} {n_params / 1e6:.1f}M parameters, "
        f"{policy.label} on {device}, {total} steps of "
        f"{recipe.data.global_batch_size} x {recipe.data.seq_len} tokens, {len(samples.train_ids):,} "
        f"training samples ({dataset.num_tokens:,} tokens) -> {run_path}"
    )
    return lines


def _train_loop(recipe, model, optimizer, policy, device, stream, val_batches, checkpoints, logger,
                compiled, result, stop_at, progress, banner) -> TrainResult:
    run_path, total, start = result.run_dir, recipe.train.steps, result.start_step
    for i, line in enumerate(banner):
        if progress or i < len(banner) - 1:  # the last line is the summary, shown with progress
            tqdm.write(line)

    tokens_per_step = recipe.data.global_batch_size * recipe.data.seq_len
    flops_per_token = training_flops_per_token(
        model, recipe.model.num_layers, recipe.model.hidden_size, recipe.data.seq_len
    )
    peak = (
        recipe.metrics.peak_tflops * 1e12
        if recipe.metrics.peak_tflops
        else peak_flops(device, policy.compute_dtype, cache_dir() / "peak_flops.json")
    )  # of the dtype the products run in: float32 where a bf16 policy computes in fp32
    autocast = policy.autocast_context(device)
    memory: dict[str, float] = {}

    def warmed_up(phase: str, step: int, fn):
        """Compiled phases say how their warm-up went once, after their first call."""
        first = compiled.enabled and phase not in compiled.warmed
        out = compiled.run(phase, step, fn, reset=lambda: optimizer.zero_grad(set_to_none=True))
        if first:
            logger.log("compile", step, _compile_record(compiled.stats))
            if progress:
                tqdm.write(_compile_line(phase, compiled.stats))
        return out

    def evaluate(step: int) -> float:
        loss = warmed_up("eval", step, lambda: _evaluate(model, val_batches, device, autocast))
        logger.log("eval", step, {"loss": loss, "perplexity": _perplexity(loss)})
        result.evals[step] = loss
        return loss

    stop = _StopFlag()
    step_times, train_loss = [], float("nan")
    wall_start = time.perf_counter()
    bar = tqdm(total=stop_at, initial=start, unit="step", disable=not progress, dynamic_ncols=True)
    with stop.installed():
        if start == 0:
            evaluate(0)
        for step in range(start, stop_at):
            t0 = time.perf_counter()
            lr = learning_rate(step, total, recipe.optim.lr, recipe.optim.min_lr, recipe.optim.warmup_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batches = stream.next_step()
            train_loss, grad_norm = warmed_up("train", step + 1, lambda: train_step(
                model, optimizer, batches, device, autocast, recipe.optim.grad_clip))
            elapsed = time.perf_counter() - t0
            step_times.append(elapsed)
            done = step + 1
            if not memory:  # after the first step, when gradients and moments exist
                memory = _memory_record(model, optimizer, policy, device)
                logger.log("memory", done, memory)
            tokens_per_s = tokens_per_step / elapsed
            if done % recipe.train.log_interval == 0 or done == stop_at:
                logger.log("train", done, {
                    "loss": train_loss,
                    "grad_norm": grad_norm,
                    "lr": lr,
                    "tokens_per_s": tokens_per_s,
                    "mfu": mfu(flops_per_token * tokens_per_s, peak),
                    "step_time_s": elapsed,
                    "tokens": done * tokens_per_step,
                    "epoch": stream.epoch,
                })
            bar.update(1)
            bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            if not math.isfinite(train_loss):
                bar.close()
                raise RuntimeError(f"training loss became {train_loss} at step {done}; stopping")
            if done % recipe.train.eval_interval == 0 or done == total:
                val = evaluate(done)
                bar.set_postfix(loss=f"{train_loss:.3f}", val=f"{val:.3f}", refresh=False)
            if done % recipe.train.save_interval == 0 or done == stop_at or stop.requested:
                extra = {"data": stream.state_dict(), "rng": _rng_state(), "step": done}
                checkpoints.save(done, model, optimizer, extra)
            result.final_step = done
            if stop.requested:
                result.interrupted = True
                tqdm.write(f"stopped by signal after step {done}; checkpoint saved, rerun to resume")
                break
    bar.close()
    compiled.close()  # idempotent; train() calls it again on the way out
    if compiled.enabled:
        logger.log("compile", result.final_step, _compile_record(compiled.stats))
    logger.close()  # flushed before the summary reads it back; closing twice is harmless

    result.summary = _summary(
        recipe, model, result, step_times, train_loss, tokens_per_step, flops_per_token, peak,
        time.perf_counter() - wall_start, device, policy,
    )
    result.summary["memory"] = memory | {"peak_memory_bytes": peak_memory_bytes(device)}
    result.summary["compile"] = compiled.stats.as_dict()
    rundir.write_summary(run_path, result.summary)
    return result


def _compile_record(stats) -> dict:
    return {k: v for k, v in stats.as_dict().items() if isinstance(v, (int, float))}


def _compile_line(phase: str, stats) -> str:
    source = "cache entry fetched from" if stats.fetched else "no cache entry at"
    line = (f"compile {stats.level}, {phase} ready: {stats.graphs} graphs so far, {stats.cache_hits} "
            f"from the cache, {stats.cache_misses} compiled, {stats.compile_s:.1f} s ({source} "
            f"{stats.cache})")
    if stats.fallbacks:
        line += f"; eager fallback for {', '.join(stats.fallbacks)}"
    return line


def _memory_record(model, optimizer, policy, device) -> dict[str, float]:
    n = sum(p.numel() for p in model.parameters())
    state = training_state_bytes(model, optimizer)
    return {
        "training_state_bytes": state,
        "bytes_per_param": state / n,
        "policy_bytes_per_param": policy.state_bytes_per_param,
        "peak_memory_bytes": peak_memory_bytes(device),
    }


def _open_dataset(recipe: Recipe, tokenizer, progress: bool) -> IndexedDataset:
    name = recipe.data.dataset
    if name.startswith(BUNDLED_PREFIX):
        try:
            prefix = bundled_dataset(name.removeprefix(BUNDLED_PREFIX), tokenizer, progress)
        except ValueError as e:
            raise UserError(f"data.dataset: {e}") from None
        return IndexedDataset(prefix)
    return IndexedDataset(name)


def train_step(model, optimizer, micro_batches, device, autocast, grad_clip) -> tuple[float, float]:
    """One optimizer step over micro-batches of (B, T + 1) tokens: forward and backward
    each (loss divided by their count), clip the global gradient norm, update.
    Returns (mean loss, gradient norm before clipping)."""
    accum = len(micro_batches)
    total = torch.zeros((), device=device)
    for batch in micro_batches:
        loss = _forward_loss(model, batch, device, autocast)
        (loss / accum).backward()
        total += loss.detach()
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    if hasattr(optimizer, "clip_grad_norm_"):  # BF16AdamW: clipping folded into its update
        norm = optimizer.clip_grad_norm_(max_norm)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return (total / accum).item(), norm.item()


def _forward_loss(model, batch, device, autocast) -> torch.Tensor:
    """Training-mode loss of one (B, T + 1) micro-batch: inputs are all but the last token,
    targets all but the first."""
    model.train()
    batch = batch.to(device, non_blocking=True)
    with autocast:
        return model(batch[:, :-1], targets=batch[:, 1:])


@torch.no_grad()
def _evaluate(model, batches, device, autocast) -> float:
    model.eval()
    losses = []
    for batch in batches:
        batch = batch.to(device)
        with autocast:
            losses.append(model(batch[:, :-1], targets=batch[:, 1:]))
    return torch.stack(losses).mean().item()


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


class _StopFlag:
    """SIGINT/SIGTERM (Ctrl-C, SLURM preemption) finish the current step and checkpoint."""

    def __init__(self) -> None:
        self.requested = False

    def _handle(self, signum, frame) -> None:
        if self.requested:  # a second signal: stop now
            raise KeyboardInterrupt
        self.requested = True

    @contextlib.contextmanager
    def installed(self):
        try:
            previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not the main thread: leave signals alone
            yield
            return
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def _summary(recipe, model, result, step_times, train_loss, tokens_per_step, flops_per_token, peak,
             wall_s, device, policy) -> dict:
    steps_run = len(step_times)
    # The first steps pay for allocator warm-up; the median is the steady state.
    median = statistics.median(step_times) if step_times else float("nan")
    # Validation losses of the whole run, this session's and earlier ones'.
    evals = dict(result.evals)
    for line in (result.run_dir / rundir.METRICS_FILE).read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "eval":
            evals.setdefault(record["step"], record["loss"])
    return {
        "recipe": recipe.name,
        "device": str(device),
        "precision": policy.label,
        "precision_requested": recipe.train.precision,
        "parameters": sum(p.numel() for p in model.parameters()),
        "non_embedding_parameters": non_embedding_params(model),
        "start_step": result.start_step,
        "final_step": result.final_step,
        "total_steps": recipe.train.steps,
        "interrupted": result.interrupted,
        "tokens_seen": result.final_step * tokens_per_step,
        "wall_time_s": round(wall_s, 2),
        "train_time_s": round(sum(step_times), 2),
        "median_step_time_s": round(median, 4),
        "median_tokens_per_s": round(tokens_per_step / median, 1) if steps_run else None,
        "median_mfu": _rounded(mfu(flops_per_token * tokens_per_step / median, peak)) if steps_run else None,
        "peak_flops": peak,
        "final_train_loss": train_loss if steps_run else None,
        "first_val_loss": evals[min(evals)] if evals else None,
        "final_val_loss": evals[max(evals)] if evals else None,
        "val_losses": {str(k): v for k, v in sorted(evals.items())},
    }


def _rounded(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)
