"""`frugality bench train`: training throughput of frugality against its peers
(`frugality.bench.peers`: transformers eager and compiled, litgpt, ...).

All run in one process on the same device with the same architecture, batch, sequence
length and precision class, one step each in turn (A B C A B C ...) after warm-up steps
(which hold any compilation: their time is reported apart), so that machine noise hits all
alike; the table reports medians. Peak memory is measured per implementation in a fresh
subprocess, since a process's peak cannot be split between models living in it. A peer
that cannot run here is a row saying why.

Over ranks (`bench train --nproc N`, each rank a process torchrun starts, one precision a
launch), frugality alone runs the recipe's layout as `train` does (its data-parallel
strategy, tensor and pipeline degrees, its micro-batches and accumulation); a step's time is
the slowest rank's, tokens/s count every data-parallel rank's batch, and the peak memory is
the heaviest rank's after two steps (its process trained frugality alone; read before the
matmul probe's matrices exist).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import NamedTuple, cast

import torch

from frugality import distributed
from frugality.backends import backend
from frugality.bench.peers import PeerUnavailable, build_peer
from frugality.bench.scale import layout_name
from frugality.config.recipe import Recipe
from frugality.distributed import World
from frugality.hardware import device_name
from frugality.metrics.flops import training_flops_per_token
from frugality.metrics.memory import peak_memory_bytes, training_state_bytes
from frugality.metrics.peak import PeakProbe, mfu, peak_flops
from frugality.precision import get_policy, resolve_policy
from frugality.runtime.activation_checkpointing import checkpointing_of
from frugality.runtime.device import resolve_device
from frugality.runtime.host_memory import keep_freed_memory
from frugality.runtime.layout import plan_layout
from frugality.runtime.state import build_state
from frugality.training.loop import train_step
from frugality.training.trainer import out_of_memory


@dataclass
class BenchRow:
    impl: str
    precision: str
    batch: int
    seq: int
    tokens_per_s: float | None  # None: the implementation could not run here (`skipped` says why)
    step_time_s: float | None
    mfu: float | None  # None where the peak is unknown or the ratio would pass 100%
    peak_memory_bytes: int | None
    state_bytes_per_param: float | None
    steps: int
    device: str
    compile_level: str | None = None  # frugality's level; "torch.compile" for compiled peers
    # frugality's tokens/s over this peer's in the same pass (on frugality's row: over the
    # fastest peer's, named in `versus`)
    speedup: float | None = None
    # The same ratio step by step: the peer's step time over frugality's step just before
    # it, whose conditions it shares; quartiles (q1, median, q3) over the timed pairs
    speedup_pairs: tuple[float, float, float] | None = None
    # MFU against the matmul probe sampled between this pass's steps, rather than against
    # the cached peak: on a shared machine whose speed drifts, the peak of the moment
    runs_as: str | None = None  # the policy as it ran here, e.g. "bf16-sr (fp32 products)"
    pass_peak_flops: float | None = None
    mfu_vs_pass_peak: float | None = None
    warmup_s: float | None = None  # the warm-up steps' time: compilation, for compiled implementations
    versus: str | None = None  # frugality's row: the peer its speedup is against
    skipped: str | None = None  # why the implementation did not run here
    activation_checkpointing: str = "none"  # the blocks recomputed in backward: none, selective, full
    ranks: int = 1  # processes the implementation ran over (torchrun's ranks)
    layout: str | None = None  # over ranks: the layout, e.g. "tp2 x ddp2"; `batch` is each data-parallel rank's
    rank_parameters: int | None = None  # over ranks: the parameters rank 0 holds (its shard, its stage)
    # (over ranks, `peak_memory_bytes` is the heaviest rank's, `warmup_s` the slowest's)


class Runner(NamedTuple):
    step: Callable[[torch.Tensor], float | None]  # one optimizer step over a batch
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    session: object | None  # frugality's compile session
    compiles: bool
    # the whole model's non-embedding parameters where `model` is this rank's part of it
    # (a pipeline stage's), for the FLOPs of a token
    parameters: int | None = None
    world: World = World()  # the ranks and degrees it runs over, as its layout resolved them


def make_runner(
    impl: str,
    recipe: Recipe,
    precision: str,
    device: torch.device,
    batch: int,
    seq: int,
    stack: contextlib.ExitStack,
    world: World = World(),
) -> Runner:
    """A `step(batch) -> loss` closure, the objects it trains, its compile session (frugality)
    and whether it compiles. frugality's come from the same builder as `frugality train`
    (`build_state` over the layout of `world`'s ranks), at the recipe's `compile.level`, its
    compile session active until `stack` closes; a peer's from `frugality.bench.peers`
    (raising PeerUnavailable where it cannot run)."""
    torch.manual_seed(recipe.seed)
    if impl == "frugality":
        layout = plan_layout(for_shape(recipe, precision, batch, seq, world), device, world)
        state = build_state(layout)
        model, optimizer, session = state.model, state.optimizer, state.compiled
        stack.enter_context(session.active(model))
        reset = lambda: optimizer.zero_grad(set_to_none=True)
        numbers = itertools.count(1)  # step numbers for the guard's messages
        micro = layout.recipe.data.micro_batch_size  # (a pipeline's schedule takes the batch in these)
        run = lambda b: train_step(state, list(b.split(micro)))
        step = lambda b: session.run("train", next(numbers), lambda: run(b), reset)[0]
        whole = state.pipeline.non_embedding_parameters if state.pipeline is not None else None
        return Runner(step, model, optimizer, session, session.enabled, whole, layout.world)
    peer = build_peer(impl, recipe, precision, device)
    return Runner(peer.step, peer.model, peer.optimizer, None, peer.compiled)


def for_shape(recipe: Recipe, precision: str, batch: int, seq: int, world: World = World()) -> Recipe:
    """`recipe` at `precision`, each data-parallel rank training `batch` x `seq` tokens a
    step. In one process, one micro-batch of them (a recipe's tensor and pipeline degrees
    set aside: one process's race); over ranks, the recipe's layout, its parallel degrees
    and micro-batch kept (the layout fits the micro-batch to the batch, and a pipeline's
    schedule to its stages, as for `train`). SPMD is XLA's, which trains in one process."""
    if world.distributed:
        data_ranks = world.world_size // (recipe.parallel.tensor * recipe.parallel.pipeline)
        shape = {"global_batch_size": batch * max(1, data_ranks), "seq_len": seq}
        parallel = recipe.parallel.model_copy(update={"spmd": False})
    else:
        shape = {"micro_batch_size": batch, "global_batch_size": batch, "seq_len": seq}
        one = {"tensor": 1, "pipeline": 1, "pipeline_microbatches": None, "spmd": False}
        parallel = recipe.parallel.model_copy(update=one)
    data = recipe.data.model_copy(update=shape)
    train = recipe.train.model_copy(update={"precision": precision})
    return recipe.model_copy(update={"data": data, "train": train, "parallel": parallel})


def random_batch(recipe: Recipe, batch: int, seq: int, device: torch.device, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, recipe.model.vocab_size, (batch, seq + 1), generator=g).to(device)


def _sync(device: torch.device) -> None:
    backend(device).synchronize()


def bench_train(
    recipe: Recipe,
    precisions: list[str],
    batch: int,
    seq: int,
    steps: int = 5,
    warmup: int = 2,
    impls=("frugality", "transformers"),
    memory: bool = True,
    baseline: str | None = None,
    log=print,
    peer_precisions: dict[str, str] | None = None,
) -> list[BenchRow]:
    """One pass per precision, the implementations alternating within it. A peer runs at
    `peer_precisions[peer]`, else at `baseline` when given (e.g. frugality's bf16-sr against
    amp-bf16, the usual way to train the peers), else at the pass's precision."""
    device = resolve_device(recipe.train.device, what="frugality bench")
    world = distributed.world_from_env()
    if world.distributed:  # a rank of `bench train --nproc N`: frugality alone, at the recipe's layout
        if tuple(impls) != ("frugality",):
            raise ValueError(f"over ranks frugality alone runs, not {', '.join(impls)}")
        world = distributed.init(device, recipe.parallel.timeout_s)
        device = distributed.local_device(device, world)
    if backend(device).host_memory:
        # as `train` runs without activation checkpointing, for every implementation (one
        # setting a process: a checkpointing mode's steps are timed with freed memory kept
        # here, though its memory probe below and `train` leave glibc's defaults)
        keep_freed_memory()
    rows = []
    for precision in precisions:
        with contextlib.ExitStack() as stack:  # frugality's compile session, for the pass
            passed = _bench_pass(
                recipe,
                precision,
                batch,
                seq,
                steps,
                warmup,
                impls,
                memory,
                baseline,
                log,
                peer_precisions,
                device,
                stack,
                world,
            )
        # each implementation's peak in a fresh process of its own, once this pass's models are
        # gone from this one (a model that fills a GPU leaves no room for a second)
        if memory and not world.distributed:
            gc.collect()
            backend(device).release_cached()
            for row in passed:
                if row.skipped is None:
                    row.peak_memory_bytes = _peak_memory_subprocess(row.impl, recipe, row.precision, batch, seq)
        rows += passed
    return rows


def _bench_pass(
    recipe, precision, batch, seq, steps, warmup, impls, memory, baseline, log, peer_precisions, device, stack, world
) -> list[BenchRow]:
    """One precision's pass: every implementation's steps, alternating, and their rows."""
    rows = []
    peer_default = baseline or precision
    if peer_default == "auto":  # what `auto` picks, in the peers' usual form: amp-bf16 for bf16
        # (amp-fp16, on GPUs without bf16: the peers run fp32, which they have)
        peer_default = "amp-bf16" if resolve_policy("auto", device)[0].compute_dtype == torch.bfloat16 else "fp32"
    impl_precision = {
        impl: precision if impl == "frugality" else (peer_precisions or {}).get(impl) or peer_default for impl in impls
    }
    runners, skipped = {}, {}
    for impl in impls:
        try:
            runners[impl] = make_runner(impl, recipe, impl_precision[impl], device, batch, seq, stack, world)
        except PeerUnavailable as e:
            skipped[impl] = str(e)
            log(f"{impl:21} skipped: {e}")
        except (torch.OutOfMemoryError, RuntimeError) as e:  # a peer too large for the device: a row saying so
            if impl == "frugality" or not out_of_memory(e):
                raise
            skipped[impl] = _does_not_fit(e, device, "building it")
            log(f"{impl:21} {skipped[impl]}")
    running = [impl for impl in impls if impl in runners]
    first = runners[running[0]] if running else None
    m = recipe.model
    flops_per_token = (
        training_flops_per_token(first.model, m.num_layers, m.hidden_size, seq, first.parameters) if first else 0.0
    )
    # over ranks: every data-parallel rank's batch a step, against every device's peak
    built = runners["frugality"].world if "frugality" in runners else world  # (degrees as the layout resolved them)
    data_ranks = built.data_size
    layout = layout_name(built.tensor, built.pipeline, data_ranks, recipe.parallel.data) if world.distributed else None
    times: dict[str, list[float]] = {impl: [] for impl in running}
    warmup_s = {impl: 0.0 for impl in running}
    dtypes = {impl: _policy(impl, impl_precision[impl], device).compute_dtype for impl in running}
    make_probes = lambda: {dtype: PeakProbe(device, dtype) for dtype in set(dtypes.values())}
    # over ranks the rank's peak is read in this process, after two steps (as the fresh
    # process of one implementation trains), before the probes' matrices exist
    read_peak_at = min(1, warmup + steps - 1) if world.distributed else None
    rank_peak = None
    probes = make_probes() if read_peak_at is None else {}
    probe_rates: dict[torch.dtype, list[float]] = {dtype: [] for dtype in set(dtypes.values())}
    ours = runners["frugality"][3] if "frugality" in runners else None
    dropped = False
    for i in range(warmup + steps):
        data = random_batch(recipe, batch, seq, device, i)
        for impl in list(running):  # A B C A B C ...: the same conditions for all
            step = runners[impl][0]
            # a compiled peer's graphs are its own, not frugality's (counted, published)
            with ours.outside() if ours is not None and impl != "frugality" else contextlib.nullcontext():
                _sync(device)
                if world.distributed:  # every rank starts the step together
                    torch.distributed.barrier()
                t0 = time.perf_counter()
                try:
                    step(data)
                except Exception as e:  # noqa: BLE001 - a peer that fails (to compile) is a row saying so
                    if impl == "frugality" or (i >= warmup and not out_of_memory(e)):
                        raise
                    why = f"failed in its warm-up: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    skipped[impl] = _does_not_fit(e, device, f"in step {i + 1}") if out_of_memory(e) else why
                    log(f"{impl:21} {skipped[impl]}")
                    running.remove(impl)
                    del runners[impl]  # (its model and optimizer state freed for the others)
                    step, dropped = None, True  # (the closure held them too; collected below)
                    continue
                _sync(device)
                seconds = time.perf_counter() - t0
            if i >= warmup:
                times[impl].append(seconds)
            else:
                warmup_s[impl] += seconds
        if dropped:  # a peer dropped this round: its state collected before the next step
            gc.collect()
            dropped = False
        if i == read_peak_at:
            rank_peak = peak_memory_bytes(device) if memory else None
            probes = make_probes()
        if i >= warmup:
            for dtype, probe in probes.items():
                probe_rates[dtype].append(probe.sample())
    del probes
    if world.distributed:  # the layout's: a step as long as its slowest rank's, the heaviest rank's peak
        times["frugality"], warmup_s["frugality"], rank_peak = _across_ranks(
            times["frugality"], warmup_s["frugality"], rank_peak
        )
    for impl in impls:
        if impl in skipped:
            rows.append(
                BenchRow(
                    impl=impl,
                    precision=impl_precision[impl],
                    batch=batch,
                    seq=seq,
                    tokens_per_s=None,
                    step_time_s=None,
                    mfu=None,
                    peak_memory_bytes=None,
                    state_bytes_per_param=None,
                    steps=0,
                    device=device_name(device),
                    skipped=skipped[impl],
                )
            )
            continue
        model, optimizer, compiles = runners[impl].model, runners[impl].optimizer, runners[impl].compiles
        recomputes = checkpointing_of(model)
        median = statistics.median(times[impl])
        tokens_per_s = batch * seq * data_ranks / median
        devices = world.world_size  # tokens/s are every rank's: against every device's peak
        peak = peak_flops(device, dtypes[impl]) * devices
        pass_peak = statistics.median(probe_rates[dtypes[impl]]) * devices
        mem = rank_peak  # (one process: measured once the pass's models are gone, by `bench_train`)
        rows.append(
            BenchRow(
                impl=impl,
                precision=impl_precision[impl],
                batch=batch,
                seq=seq,
                tokens_per_s=round(tokens_per_s, 1),
                step_time_s=_significant(median),
                mfu=_significant(mfu(flops_per_token * tokens_per_s, peak)),
                peak_memory_bytes=mem,
                state_bytes_per_param=round(
                    training_state_bytes(model, optimizer) / sum(_local_numel(p) for p in model.parameters()), 2
                ),
                steps=steps,
                device=device_name(device),
                compile_level=recipe.compile.level if impl == "frugality" else ("torch.compile" if compiles else None),
                runs_as=_policy(impl, impl_precision[impl], device).label,
                pass_peak_flops=round(pass_peak),
                mfu_vs_pass_peak=_significant(mfu(flops_per_token * tokens_per_s, pass_peak)),
                warmup_s=round(warmup_s[impl], 2),
                activation_checkpointing=recomputes,
                ranks=world.world_size,
                layout=layout,
                rank_parameters=sum(_local_numel(p) for p in model.parameters()) if world.distributed else None,
            )
        )
        log(
            f"{impl:21} {impl_precision[impl]:9} {tokens_per_s:9.1f} tokens/s  MFU {_percent(rows[-1].mfu)} "
            f"(vs the pass's probe: {_percent(rows[-1].mfu_vs_pass_peak)}); warm-up {warmup_s[impl]:.1f} s"
        )
    _speedups({r.impl: r for r in rows[len(rows) - len(impls) :] if r.skipped is None}, times)
    return rows


def _does_not_fit(error: BaseException, device: torch.device, when: str) -> str:
    return f"does not fit: out of memory on {device_name(device)} {when} ({str(error).splitlines()[0][:120]})"


def _local_numel(p: torch.Tensor) -> int:
    """The elements this rank holds (a tensor-parallel or FSDP2 shard's, not the whole's)."""
    from torch.distributed.tensor import DTensor

    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def _all_gather(figures) -> list:
    everyone: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, figures)
    return everyone


def _across_ranks(
    times: list[float], warmup_s: float, peak: int | None, gather=None
) -> tuple[list[float], float, int | None]:
    """Every rank's figures gathered: each step's time on the slowest rank, the slowest
    warm-up, the heaviest rank's peak (a pipeline's last stage holds the output layer).
    `gather(figures) -> [every rank's]` is torch.distributed's `all_gather_object`."""
    ranks = (gather or _all_gather)((times, warmup_s, peak))
    steps = [max(step) for step in zip(*(t for t, _, _ in ranks), strict=True)]
    peaks = [p for _, _, p in ranks if p is not None]
    return steps, max(w for _, w, _ in ranks), max(peaks) if peaks else None


def _speedups(pass_rows: dict[str, BenchRow], times: dict[str, list[float]]) -> None:
    """frugality's tokens/s over each peer's (on the peer's row), and over the fastest
    peer's on frugality's own row, with the step-by-step quartiles."""
    ours = pass_rows.get("frugality")
    peers = [r for name, r in pass_rows.items() if name != "frugality"]
    if ours is None or not peers:
        return
    for r in peers:
        r.speedup = round(_ran(ours) / _ran(r), 3)
        r.speedup_pairs = quartiles(
            [theirs / mine for mine, theirs in zip(times["frugality"], times[r.impl], strict=True)]
        )
    fastest = max(peers, key=_ran)
    ours.speedup, ours.speedup_pairs, ours.versus = fastest.speedup, fastest.speedup_pairs, fastest.impl


def _ran(row: BenchRow) -> float:
    """The tokens/s of a row that ran (not skipped)."""
    assert row.tokens_per_s is not None
    return row.tokens_per_s


def _peak_memory_subprocess(impl, recipe, precision, batch, seq) -> int | None:
    """Peak memory of a fresh process that trains two steps of one implementation."""
    command = [sys.executable, "-m", "frugality.bench.train", impl, precision, str(batch), str(seq)]
    done = subprocess.run(command, input=recipe.model_dump_json(), capture_output=True, text=True)
    if done.returncode != 0:
        return None
    return int(json.loads(done.stdout.strip().splitlines()[-1])["peak_memory_bytes"])


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3), rounded to 3 decimals; one value gives it three times."""
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return cast(tuple[float, float, float], tuple(round(v, 3) for v in q))  # (quartiles: three cut points)


def _significant(x: float | None, digits: int = 4) -> float | None:
    """Rounded to significant digits, not decimals: a small model on a large GPU has an MFU
    of 1e-5, which four decimals would report as 0."""
    return None if x is None else float(f"{x:.{digits}g}")


def _policy(impl: str, precision: str, device: torch.device):
    """frugality's policy fitted to the device; a peer runs the policy as named, and at
    bf16-sr without stochastic rounding (plain AdamW on bf16 weights, labelled so)."""
    if impl == "frugality":
        return resolve_policy(precision, device)[0]
    policy = get_policy(precision)
    if precision == "bf16-sr":
        return _Relabelled(policy, "bf16 (no stochastic rounding)")
    return policy


class _Relabelled:
    def __init__(self, policy, label: str) -> None:
        self._policy, self.label = policy, label

    def __getattr__(self, name):
        return getattr(self._policy, name)


def markdown_table(rows: list[BenchRow]) -> str:
    header = (
        "| impl | precision | compile | batch × seq | tokens/s | frugality × | step time (s) "
        "| MFU | MFU vs the pass's probe | state bytes/param | peak memory (GiB) | warm-up (s) |"
    )
    lines = [header, "|" + "---|" * 12]
    for r in rows:
        if r.skipped:
            lines.append(f"| {r.impl} | {r.precision} | | {r.batch} × {r.seq} | not run: {r.skipped} |" + " |" * 7)
            continue
        mem = f"{r.peak_memory_bytes / 2**30:.2f}" if r.peak_memory_bytes else "n/a"
        if r.layout and r.peak_memory_bytes:
            mem += " (heaviest rank)"
        speedup = f"{r.speedup:.2f}×" if r.speedup else ""
        if r.speedup_pairs:
            q1, median, q3 = r.speedup_pairs
            speedup += f" (pairs {median:.2f}×, {q1:.2f}–{q3:.2f})"
        if r.versus:
            speedup += f" vs {r.versus}"
        impl = f"{r.impl} ({r.layout}, {r.ranks} ranks)" if r.layout else r.impl
        lines.append(
            f"| {impl} | {r.runs_as or r.precision} | {r.compile_level or 'eager'}{_recompute(r)} | "
            f"{r.batch} × {r.seq} | "
            f"{r.tokens_per_s:,.0f} | {speedup} | {r.step_time_s:.3f} | {_percent(r.mfu)} | "
            f"{_percent(r.mfu_vs_pass_peak)} ({_gflops(r.pass_peak_flops)}) | "
            f"{r.state_bytes_per_param:g} | {mem} | {r.warmup_s if r.warmup_s is not None else 'n/a'} |"
        )
    return "\n".join(lines)


def _recompute(r: BenchRow) -> str:
    return "" if r.activation_checkpointing == "none" else f", {r.activation_checkpointing} recompute"


def _percent(x: float | None) -> str:
    return f"{x:.1%}" if x is not None else "n/a"


def _gflops(x: float | None) -> str:
    return f"{x / 1e9:,.0f} GFLOP/s" if x is not None else "n/a"


def rows_json(rows: list[BenchRow]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=1)


def _memory_probe() -> None:
    """Child process: train two steps of one implementation, print the peak as JSON."""
    impl, precision, batch, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    recipe = Recipe.model_validate_json(sys.stdin.read())
    device = resolve_device(recipe.train.device, what="frugality bench")
    # freed memory kept as `train` keeps it: not under an activation checkpointing mode
    # (frugality.runtime.host_memory); a peer as frugality without one
    mode = "none"
    if impl == "frugality":
        mode = plan_layout(for_shape(recipe, precision, batch, seq), device).checkpointing[0]
    if backend(device).host_memory and mode == "none":
        keep_freed_memory()
    with contextlib.ExitStack() as stack:
        step = make_runner(impl, recipe, precision, device, batch, seq, stack)[0]
        for i in range(2):
            step(random_batch(recipe, batch, seq, device, i))
    print(json.dumps({"peak_memory_bytes": peak_memory_bytes(device)}))


if __name__ == "__main__":
    _memory_probe()
