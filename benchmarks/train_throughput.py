"""Training throughput: frugality vs transformers' GPTNeoXForCausalLM + torch AdamW.

Pythia-70m architecture, batch 4 x 512 tokens by default (16 x 2048 for the GPU table). Two
tables, each pass alternating the two implementations step by step in one process (medians
of the timed steps):
1. the headline: frugality's bf16-sr against transformers' amp-bf16 (autocast, the usual
   way to train it in bf16), once with frugality eager and once at --level; on GPUs of
   compute capability 8.9 or later also frugality's fp8 at --level;
2. every precision policy against transformers at the same precision, frugality at --level.
Peak memory from a fresh subprocess per implementation. Writes Markdown and JSON to
benchmarks/results/, named by model, machine and date.

    .venv/bin/python benchmarks/train_throughput.py [--level O1] [--steps 7] [--warmup 2]
        [--batch 4 --seq 512]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from frugality.bench.results import machine_line, write_results
from frugality.bench.train import bench_train, markdown_table, rows_json
from frugality.config.recipe import load_recipe
from frugality.metrics.peak import peak_flops


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="pythia-70m")
    parser.add_argument("--precision", default="fp32,amp-bf16,bf16-sr,bf16")
    parser.add_argument("--level", default="O1", help="frugality's compile level (transformers runs eagerly)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    log = lambda line: print(line, file=sys.stderr)
    run = lambda level, precisions, **kw: bench_train(
        load_recipe(args.recipe, [f"compile.level={level}"]),
        precisions,
        args.batch,
        args.seq,
        args.steps,
        args.warmup,
        log=log,
        **kw,
    )
    headline = []
    for level in dict.fromkeys(["O0", args.level]):
        headline += run(level, ["bf16-sr"], baseline="amp-bf16")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fp8 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    if fp8:  # float8 linears (torchao) where the GPU has float8 tensor cores
        headline += run(args.level, ["fp8"], baseline="amp-bf16")
    policies = run(args.level, args.precision.split(","))

    peaks = ", ".join(
        f"{dtype}: {peak_flops(device, getattr(torch, dtype)) / 1e9:,.0f} GFLOP/s cached"
        for dtype in ("float32", "bfloat16")
    )
    header = (
        f"# Training throughput, {args.recipe} architecture, batch {args.batch} x {args.seq}\n\n"
        f"{machine_line()}\n"
        f"Each pass alternates frugality and transformers step by step in one process; medians of "
        f"{args.steps} timed steps after {args.warmup} warm-up steps (frugality's compilation "
        f"happens in the warm-up). frugality ×: the ratio of the medians (frugality over transformers), in parentheses "
        f"the median and quartiles of the ratio within each step pair (transformers' step over "
        f"frugality's step just before it, run in the same conditions). "
        f"MFU against the measured matmul peak of the compute dtype "
        f"(fp32 for fp32, bf16 otherwise; {peaks}), 6N + 12·L·H·T FLOPs per token; "
        f"the next column against the same probe sampled after every timed step pair of the pass "
        f"(median), since this machine's speed drifts. Peak memory: a fresh "
        f"process training two steps of one implementation "
        f"({'allocator peak' if device.type == 'cuda' else 'peak resident set'}).\n\n"
        f"## bf16-sr{' and fp8' if fp8 else ''} against transformers with autocast bf16\n\n"
        + (
            "fp8 rows: MFU against the bf16 peak, though their linears run float8 products "
            "(up to twice the bf16 rate on this GPU).\n\n"
            if fp8
            else ""
        )
        + f"{markdown_table(headline)}\n\n"
        f"## Every policy against transformers at the same precision (frugality at {args.level})\n\n"
    )
    write_results(
        Path(__file__).parent / "results",
        "train_throughput",
        args.recipe,
        header,
        markdown_table(policies),
        json.dumps(
            {"headline": json.loads(rows_json(headline)), "policies": json.loads(rows_json(policies))}, indent=1
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
