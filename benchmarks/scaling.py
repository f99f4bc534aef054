"""Scaling on this machine: `frugality bench scale` on a recipe (data parallel, and tensor
and pipeline parallel layouts when asked), written to
benchmarks/results/scaling-<recipe>-<machine>-<date>.md and .json.

    .venv/bin/python benchmarks/scaling.py [--recipe tiny] [--nproc 1,2] [--strategy ddp,fsdp] [--steps 10]
        [--tensor 2] [--pipeline 2] [--pipeline-microbatches 4] [--precision fp32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from frugality.bench.results import machine_line, write_results
from frugality.bench.scale import bench_scale, markdown_table, rows_json
from frugality.config.recipe import load_recipe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--nproc", default="1,2")
    parser.add_argument("--strategy", default="ddp,fsdp")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tensor", default="", help="comma-separated tensor-parallel degrees")
    parser.add_argument("--pipeline", default="", help="comma-separated pipeline-parallel degrees")
    parser.add_argument("--pipeline-microbatches", type=int)
    parser.add_argument("--precision", help="train.precision for every run [default: the recipe's]")
    args = parser.parse_args()
    degrees = {k: [int(n) for n in v.split(",") if n] for k, v in (("t", args.tensor), ("p", args.pipeline))}
    overrides = [f"train.precision={args.precision}"] if args.precision else []
    rows = bench_scale(
        args.recipe,
        load_recipe(args.recipe, overrides),
        overrides,
        [int(n) for n in args.nproc.split(",")],
        args.strategy.split(","),
        args.steps,
        log=lambda line: print(line, file=sys.stderr),
        tensors=degrees["t"],
        pipelines=degrees["p"],
        pipeline_microbatches=args.pipeline_microbatches,
    )
    layouts = f", tensor {args.tensor or '-'}, pipeline {args.pipeline or '-'}" if args.tensor or args.pipeline else ""
    header = (
        f"# Scaling, {args.recipe} recipe (its global batch at every process count{layouts}"
        f"{', precision ' + args.precision if args.precision else ''})\n\n"
        f"{machine_line()}\nEach row is a `frugality train --nproc N` run of {args.steps} steps; the "
        f"machine's cores split between the ranks (threads each); median step of the run; "
        f"efficiency = tokens/s over one process's.\n\n"
    )
    write_results(
        Path(__file__).parent / "results",
        "scaling" + (f"-{args.precision}" if args.precision else ""),
        args.recipe,
        header,
        markdown_table(rows),
        rows_json(rows),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
