"""Training speed of frugality's precision policies on this machine, against fp32: what
`train.precision` costs or saves where it runs, and what `auto` picks.

The policies' training steps alternate one by one in one process (same batches, fp32
first), so that a shared machine's drift hits all alike; medians of the timed steps after
warm-up steps. On hardware without native bf16 products the bf16 policies run their
products in fp32 from bf16 operands ("fp32 products"): this table is the check that they
then stay within a few percent of fp32 while keeping 8 bytes of training state per
parameter.

    .venv/bin/python benchmarks/precision_speed.py [--recipe tiny] [--precision auto,fp32,bf16-sr]
        [--steps 20] [--warmup 3] [--set KEY=VALUE ...]
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

from frugality.bench.results import machine_line, write_results
from frugality.bench.train import make_runner, quartiles, random_batch
from frugality.config.recipe import load_recipe
from frugality.hardware import probe
from frugality.metrics.flops import training_flops_per_token
from frugality.metrics.memory import training_state_bytes
from frugality.metrics.peak import mfu, peak_flops
from frugality.precision import resolve_policy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--precision", default="fp32,auto,bf16-sr,bf16,amp-bf16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    recipe = load_recipe(args.recipe, args.overrides)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch, seq = recipe.data.micro_batch_size, recipe.data.seq_len
    names = [n.strip() for n in args.precision.split(",") if n.strip()]
    policies = {name: resolve_policy(name, device) for name in names}
    stack = contextlib.ExitStack()  # the compile sessions, open until the steps are timed
    runners = {
        name: make_runner("frugality", recipe, policies[name][0].name, device, batch, seq, stack) for name in names
    }
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.warmup + args.steps):
        data = random_batch(recipe, batch, seq, device, i)
        for name in names:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            runners[name][0](data)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)

    stack.close()
    reference = names[0]
    flops_per_token = training_flops_per_token(
        runners[reference][1], recipe.model.num_layers, recipe.model.hidden_size, seq
    )
    rows = []
    for name in names:
        policy, note = policies[name]
        model, optimizer = runners[name][1], runners[name][2]
        median = statistics.median(times[name])
        peak = peak_flops(device, policy.compute_dtype)
        ratios = [ours / theirs for ours, theirs in zip(times[reference], times[name], strict=True)]
        rows.append(
            dict(
                precision=name,
                runs_as=policy.label,
                tokens_per_s=round(batch * seq / median, 1),
                step_time_s=round(median, 4),
                vs_first=quartiles(ratios),
                mfu=mfu(flops_per_token * batch * seq / median, peak),
                state_bytes_per_param=round(
                    training_state_bytes(model, optimizer) / sum(p.numel() for p in model.parameters()), 2
                ),
                note=note,
            )
        )
    table = (
        "| precision | runs as | tokens/s | step time (s) | vs " + reference + " (pairs: median, q1–q3) "
        "| MFU | state bytes/param |\n|---|---|---|---|---|---|---|\n"
    )
    for r in rows:
        q1, med, q3 = r["vs_first"]
        table += (
            f"| {r['precision']} | {r['runs_as']} | {r['tokens_per_s']:,.0f} | {r['step_time_s']:.3f} | "
            f"{med:.3f} ({q1:.3f}–{q3:.3f}) | {'n/a' if r['mfu'] is None else format(r['mfu'], '.1%')} | "
            f"{r['state_bytes_per_param']:g} |\n"
        )
    hw = probe(device)
    header = (
        f"# Precision policies' training speed, {args.recipe} recipe, batch {batch} x {seq}\n\n"
        f"{machine_line()}\nHardware: {hw.describe()}.\n"
        f"The policies alternate step by step in one process; medians of {args.steps} timed steps "
        f"after {args.warmup} warm-up steps; 'vs {reference}': {reference}'s step time over each "
        f"policy's in the same round. MFU against the measured peak of the dtype the products run "
        f"in (n/a where unknown or implausible).\n\n"
        + "".join(f"- {r['precision']}: {r['note']}\n" for r in rows)
        + "\n"
    )
    write_results(
        Path(__file__).parent / "results",
        "precision_speed",
        args.recipe,
        header,
        table,
        json.dumps(dict(hardware=hw.describe(), rows=rows), indent=1),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
