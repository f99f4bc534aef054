"""`frugality bench profile`: where a training step's time goes, by kind of work, for
frugality and its peers on the same shape — the torch profiler's op events sorted into a few
categories that explain a step:

- matrix products, split into the output layer's (an operand as wide as the vocabulary)
  and the rest (the blocks' linear layers), with the rate all products ran at;
- attention: its kernels and its batched products (bmm); the loss (softmax and cross-entropy, or
  frugality's fused output loss); the optimizer step; gradient clipping;
- compiled (Inductor-fused) kernels: the time inside compiled regions that no aten op
  claims;
- elementwise work, norms and copies (every other aten op);
- time outside every op: Python, autograd's bookkeeping (every backward node's own time),
  the C kernels frugality calls through ctypes outside a named range.

Each op's *self* time goes to one category, so the categories add up to the profiled wall
time. Steps are profiled after the warm-up (compilation), one implementation at a time,
on the CPU (a GPU's time is in its kernels, which this does not read). frugality's fused
output layer is one autograd Function (`LinearCrossEntropy`): its own time, the products it
runs through ctypes on AMX CPUs, counts as output-layer products, and its row pass has a
named range of its own (loss). The products' rate is left out when a tenth or more of the
products' time is in products whose FLOPs the profiler does not count (frugality's C
products)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from frugality.backends import backend
from frugality.bench.peers import PeerUnavailable
from frugality.bench.train import make_runner, random_batch
from frugality.config.recipe import Recipe
from frugality.errors import UserError
from frugality.runtime.device import resolve_device
from frugality.runtime.host_memory import keep_freed_memory

CATEGORIES = (
    "matrix products: output layer",
    "matrix products: blocks",
    "attention",
    "loss (softmax, cross-entropy)",
    "optimizer step",
    "gradient clipping",
    "compiled (fused) kernels",
    "elementwise, norms, copies",
    "outside ops (Python, autograd, ctypes)",
)
BATCHED_MATMULS = {"aten::bmm", "aten::baddbmm"}
MATMULS = {
    "aten::mm",
    "aten::addmm",
    "aten::addbmm",
    "aten::_mkl_linear",
    "mkl::_mkl_linear",
    "aten::mkldnn_linear",
    "mkldnn::_linear_pointwise",
    "aten::_addmm_activation",
    "frugality::linear_product",
    "frugality::weight_grad",
}
PRODUCTS = MATMULS | BATCHED_MATMULS  # every product whose time the rate divides by
OUTPUT_LAYER_FUNCTIONS = {"LinearCrossEntropy"}  # their own time: products through ctypes (AMX)
LOSS_WORDS = ("log_softmax", "nll_loss", "cross_entropy")
COMPILED_WORDS = ("Torch-Compiled Region", "CompiledFxGraph", "CompiledFunction", "## Call")


@dataclass
class StepProfile:
    impl: str
    precision: str
    batch: int
    seq: int
    steps: int
    step_s: float  # wall time per profiled step
    seconds: dict[str, float] = field(default_factory=dict)  # category -> seconds per step
    matmul_gflops: float | None = None  # the products' rate: their FLOPs over their time
    skipped: str | None = None


def categorize(name: str, ancestors: list[str], shapes: list, vocab: int) -> str:
    """The category of an op event's self time, from its name, its enclosing events' names
    and its input shapes."""
    if any(a.startswith(("Optimizer.step", "Optimizer.zero_grad")) for a in [*ancestors, name]):
        return "optimizer step"
    if name.startswith("autograd::engine::evaluate_function"):  # a backward node's own bookkeeping
        return "outside ops (Python, autograd, ctypes)"
    if name in OUTPUT_LAYER_FUNCTIONS:
        return "matrix products: output layer"
    if name in BATCHED_MATMULS:  # products of attention's scores and probabilities (blocked or math paths)
        return "attention"
    if name in MATMULS:
        wide = any(isinstance(s, (list, tuple)) and len(s) == 2 and vocab in s for s in shapes)
        return "matrix products: output layer" if wide else "matrix products: blocks"
    if "attention" in name or "flash" in name:
        return "attention"
    if any(w in name for w in LOSS_WORDS):
        return "loss (softmax, cross-entropy)"
    if (
        name.startswith(("aten::_foreach_norm", "aten::linalg_vector_norm", "aten::_foreach_mul"))
        or "clip_grad" in name
        or "get_total_norm" in name
    ):
        return "gradient clipping"
    if any(w in name for w in COMPILED_WORDS):
        return "compiled (fused) kernels"
    if name.startswith(("aten::", "frugality::")):  # frugality's: its GELU kernel
        return "elementwise, norms, copies"
    return "outside ops (Python, autograd, ctypes)"


def profile_steps(
    recipe: Recipe, impl: str, precision: str, batch: int, seq: int, steps: int = 2, warmup: int = 2, log=print
) -> StepProfile:
    """Profile `steps` steps of `impl` (frugality or a peer) after `warmup` steps; a peer that
    cannot run here, or fails in its warm-up, is a row saying why."""
    device = resolve_device(recipe.train.device, what="frugality bench")
    if not backend(device).on_host:
        raise UserError(
            f"bench profile reads CPU time; {device} runs its work in kernels this version does not "
            "read (--set train.device=cpu, or torch.profiler with CUDA activity)"
        )
    keep_freed_memory()  # as in training and bench train: no page faults charged to big buffers
    row = StepProfile(impl, precision, batch, seq, steps, 0.0)
    with contextlib.ExitStack() as stack:
        try:
            step, *_ = make_runner(impl, recipe, precision, device, batch, seq, stack)
        except PeerUnavailable as e:
            row.skipped = str(e)
            return row
        batches = [random_batch(recipe, batch, seq, device, i) for i in range(warmup + steps)]
        for i in range(warmup):
            try:
                step(batches[i])
            except Exception as e:  # noqa: BLE001 - a peer that fails (to compile) is a row saying so
                if impl == "frugality":
                    raise
                row.skipped = f"failed in its warm-up: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                return row
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True, with_flops=True
        ) as prof:
            t0 = time.perf_counter()
            for b in batches[warmup:]:
                step(b)
            wall = time.perf_counter() - t0
    seconds: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
    flops = counted_s = uncounted_s = 0.0
    events = prof.events()
    assert events is not None  # (the profiler has run)
    for event in events:
        if event.device_type != torch.profiler.DeviceType.CPU:
            continue
        ancestors, parent = [], event.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        category = categorize(event.name, ancestors, event.input_shapes or [], recipe.model.vocab_size)
        self_s = event.self_cpu_time_total / 1e6
        seconds[category] += self_s
        if category == "optimizer step" or not (event.name in PRODUCTS or category.startswith("matrix products")):
            continue
        if event.flops:  # aten's products: FLOPs from their shapes
            flops, counted_s = flops + event.flops, counted_s + self_s
        else:  # frugality's C products
            uncounted_s += self_s
    inside = sum(seconds.values())
    seconds["outside ops (Python, autograd, ctypes)"] += max(wall - inside, 0.0)
    row.step_s = wall / steps
    row.seconds = {k: v / steps for k, v in seconds.items()}
    if counted_s and uncounted_s < 0.1 * (counted_s + uncounted_s):
        row.matmul_gflops = flops / counted_s / 1e9
    log(
        f"{impl:21} {row.step_s:.3f} s/step; products "
        f"{'n/a' if row.matmul_gflops is None else f'{row.matmul_gflops:.0f} GFLOP/s'}"
    )
    return row


def markdown_table(rows: list[StepProfile]) -> str:
    ran = [r for r in rows if r.skipped is None]
    head = "| seconds per step (share) | " + " | ".join(f"{r.impl} {r.precision}" for r in ran) + " |"
    lines = [head, "|---|" + "---|" * len(ran)]
    for category in CATEGORIES:
        cells = [f"{r.seconds[category]:.3f} ({r.seconds[category] / r.step_s:.0%})" for r in ran]
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    lines.append("| **step** | " + " | ".join(f"**{r.step_s:.3f}**" for r in ran) + " |")
    lines.append(
        "| matrix products' rate (attention's included), GFLOP/s | "
        + " | ".join("—" if r.matmul_gflops is None else f"{r.matmul_gflops:.0f}" for r in ran)
        + " |"
    )
    lines += [f"\n{r.impl}: not profiled: {r.skipped}" for r in rows if r.skipped is not None]
    return "\n".join(lines)


def rows_json(rows: list[StepProfile]) -> str:
    import json
    from dataclasses import asdict

    return json.dumps([asdict(r) for r in rows], indent=1)
