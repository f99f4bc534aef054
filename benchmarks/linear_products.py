"""Linear layers' three products in bf16 on this CPU: the AMX kernels of
frugality.kernels.linear against the oneDNN products they replaced, at Pythia-70m's
shapes and 2048 tokens (4 x 512): the forward product x W^T + b (`product`), the input
gradient dY W (`product`) and the weight gradient dY^T X (`weight_grad`), for the four
block layers and the output layer (its input gradient, K = 50k, through the kernel's
chunked variant). The output layer's oneDNN paths transposed the weight (forward) or both
operands and the result (weight gradient): oneDNN is faster that way round.

Medians of --repeats calls per path, alternating; relative error of each path's result
against the float64 product (largest absolute difference / largest magnitude). Then whole
training steps: Pythia-70m, bf16-sr at compile level O1, 4 x 512 tokens, the model with
the kernels' linear layers against the same model with plain nn.Linear in its blocks (both
built from the same seed, trained on the same batches; the output layer the same in both),
--steps steps each, alternating in one process after two warm-up steps. Writes
benchmarks/results/linear_products-<machine>-<date>.md. Needs a CPU with AMX.

    .venv/bin/python benchmarks/linear_products.py [--tokens 2048] [--repeats 15] [--steps 20]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from frugality import kernels
from frugality.bench.results import machine_line, race, write_results
from frugality.bench.train import make_runner, random_batch
from frugality.config.recipe import load_recipe
from frugality.kernels import linear as cpu_linear
from frugality.kernels.linear import amx_product_applies, product, weight_grad, weight_grad_applies
from frugality.runtime.host_memory import keep_freed_memory

SHAPES = [
    ("attention qkv", 1536, 512),
    ("attention out", 512, 512),
    ("mlp up", 2048, 512),
    ("mlp down", 512, 2048),
    ("output layer", 50304, 512),
]  # (layer, outputs, inputs)


def _cases(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grad_out: torch.Tensor, wide: bool):
    """(product, the AMX path, (the replaced path's name, the path), the float64 reference) of
    one layer's products; `wide`: the output layer, whose previous paths were its own."""
    cases = [
        (
            "forward",
            lambda: product(x, weight, bias, True),
            ("oneDNN, weight transposed", lambda: x @ kernels.transposed(weight))
            if wide
            else ("oneDNN (F.linear)", lambda: torch.nn.functional.linear(x, weight, bias)),
            lambda: x.double() @ weight.double().t() + (0 if bias is None else bias.double()),
        ),
        (
            "weight gradient",
            lambda: weight_grad(grad_out, x)[0],
            ("oneDNN, operands and result transposed", lambda: kernels.transposed(kernels.transposed(x) @ grad_out))
            if wide
            else ("oneDNN (torch.mm)", lambda: grad_out.t() @ x),
            lambda: grad_out.double().t() @ x.double(),
        ),
    ]
    if amx_product_applies(grad_out, weight, None, False):
        cases.insert(
            1,
            (
                "input gradient",
                lambda: product(grad_out, weight, None, False),
                ("oneDNN (torch.mm)", lambda: grad_out @ weight),
                lambda: grad_out.double() @ weight.double(),
            ),
        )
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    keep_freed_memory()  # as in training
    device = torch.device("cpu")
    torch.manual_seed(0)
    rows = []
    for layer, outputs, inputs in SHAPES:
        x = torch.randn(args.tokens, inputs).to(torch.bfloat16)
        weight = (torch.randn(outputs, inputs) * inputs**-0.5).to(torch.bfloat16)
        bias = None if outputs > 4096 else (torch.randn(outputs) * 0.02).to(torch.bfloat16)
        grad_out = (torch.randn(args.tokens, outputs) * 0.02).to(torch.bfloat16)
        if not (weight_grad_applies(grad_out, x) and amx_product_applies(x, weight, bias, True)):
            print("the AMX kernels do not run on this machine", file=sys.stderr)
            return 1
        wide = outputs > 4096  # the output layer: its previous paths (frugality.kernels.output_loss)
        for product_name, new, (old_name, old), exact in _cases(x, weight, bias, grad_out, wide):
            t = race(device, args.repeats, new=new, old=old)
            reference = exact()
            error = lambda y, reference=reference: ((y.double() - reference).abs().max() / reference.abs().max()).item()
            flops = 2 * args.tokens * outputs * inputs
            rows.append(
                dict(
                    layer=layer,
                    shape=f"{outputs} x {inputs}",
                    product=product_name,
                    path="AMX kernel",
                    ms=t["new"] * 1e3,
                    gflops=flops / t["new"] / 1e9,
                    replaced_path=old_name,
                    replaced_ms=t["old"] * 1e3,
                    replaced_gflops=flops / t["old"] / 1e9,
                    error=error(new()),
                    replaced_error=error(old()),
                )
            )
    table = (
        "| layer | weight | product | path | ms | GFLOP/s | replaced path | ms | GFLOP/s | speed-up | "
        "relative error vs float64 (path / replaced) |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    for r in rows:
        table += (
            f"| {r['layer']} | {r['shape']} | {r['product']} | {r['path']} | {r['ms']:.2f} | {r['gflops']:.0f} | "
            f"{r['replaced_path']} | {r['replaced_ms']:.2f} | {r['replaced_gflops']:.0f} | "
            f"{r['replaced_ms'] / r['ms']:.2f}× | {r['error']:.1e} / {r['replaced_error']:.1e} |\n"
        )
    steps = _steps(args.steps)
    table += (
        "\nWhole training steps (Pythia-70m, bf16-sr, O1, 4 x 512 tokens), "
        f"{args.steps} per model, alternating:\n\n"
        "| linear layers | median step (s) | first quartile (s) | fastest (s) | last loss |\n"
        "|---|---|---|---|---|\n"
    )
    for name, times, loss in steps:
        q1 = statistics.quantiles(times, n=4, method="inclusive")[0]
        table += f"| {name} | {statistics.median(times):.3f} | {q1:.3f} | {min(times):.3f} | {loss:.4f} |\n"
    header = (
        f"# Products of linear layers, Pythia-70m shapes, {args.tokens} tokens, bf16\n\n"
        f"{machine_line()}\nMedians of {args.repeats} calls per path, alternating, after one "
        "warm-up call each.\n\n"
    )
    write_results(
        Path(__file__).parent / "results",
        "linear_products",
        "pythia-70m",
        header,
        table,
        json.dumps(
            dict(products=rows, steps=[dict(linear=n, seconds=t, last_loss=last) for n, t, last in steps]), indent=1
        ),
    )
    return 0


def _steps(count: int) -> list[tuple[str, list[float], float]]:
    """(linear layers, step times, last loss) for the model as built and for the same model
    with its AMXLinear layers turned into plain nn.Linear."""
    recipe = load_recipe("pythia-70m", ["compile.level=O1", "train.device=cpu"])
    device = torch.device("cpu")
    stack = contextlib.ExitStack()  # the compile sessions, closed when the steps are done
    kernel_step = make_runner("frugality", recipe, "bf16-sr", device, 4, 512, stack)[0]
    plain_step, plain_model, *_ = make_runner("frugality", recipe, "bf16-sr", device, 4, 512, stack)
    for module in plain_model.modules():
        if type(module) is cpu_linear.AMXLinear:
            # the same parameters, torch's backward (pyright: a class assigned to an instance)
            module.__class__ = torch.nn.Linear  # pyright: ignore[reportAttributeAccessIssue]
    paths = {"AMXLinear (AMX kernels)": kernel_step, "nn.Linear (oneDNN)": plain_step}
    times = {name: [] for name in paths}
    losses = {}
    for i in range(2 + count):
        batch = random_batch(recipe, 4, 512, device, i)
        for name, step in paths.items():
            t0 = time.perf_counter()
            losses[name] = step(batch)
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    stack.close()
    return [(name, times[name], losses[name]) for name in paths]


if __name__ == "__main__":
    sys.exit(main())
