"""Training throughput against the strongest peers that run on this machine: transformers
eager and compiled (`TrainingArguments(torch_compile=True)`'s way, fused AdamW), litgpt
(its model and pretraining step, compiled), and on CUDA torchtitan and liger-kernel (rows
saying they need CUDA elsewhere). One pass per batch shape, every implementation
alternating step by step in one process (medians of the timed steps; compilation in the
warm-up steps, reported apart); peak memory from a fresh process per implementation.
Precision: the machine's best class: fp32 where bf16 products are not native (frugality
fp32 against the peers in fp32), else frugality bf16-sr against the peers' amp-bf16.

    .venv/bin/python benchmarks/peers.py [--recipe pythia-70m] [--level O1] [--shapes 4x512,16x512]
        [--steps 5] [--warmup 2] [--no-memory]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from pathlib import Path

import torch

from frugality.bench.peers import PEERS
from frugality.bench.results import machine_line, write_results
from frugality.bench.train import bench_train, markdown_table, rows_json
from frugality.config.recipe import load_recipe
from frugality.hardware import probe


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="pythia-70m")
    parser.add_argument("--level", default="O1", help="frugality's compile level")
    parser.add_argument("--shapes", default="4x512,16x512")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    native = probe(device).native_bf16
    ours, theirs = ("bf16-sr", "amp-bf16") if native else ("fp32", "fp32")
    recipe = load_recipe(args.recipe, [f"compile.level={args.level}"])
    rows = []
    for shape in args.shapes.split(","):
        batch, seq = (int(x) for x in shape.split("x"))
        rows += bench_train(
            recipe,
            [ours],
            batch,
            seq,
            args.steps,
            args.warmup,
            impls=("frugality", *PEERS),
            memory=not args.no_memory,
            baseline=theirs,
            log=lambda line: print(line, file=sys.stderr),
        )
    versions = ", ".join(
        f"{p} {_version(p)}" for p in ("transformers", "litgpt", "lightning", "torchtitan", "liger-kernel")
    )
    header = (
        f"# Training throughput against the peers, {args.recipe} architecture\n\n{machine_line()} "
        f"{versions}. frugality {ours} at {args.level}, the peers at {theirs}"
        f"{'' if native else ' (bf16 products are not native here: the fp32 class)'}. Each pass alternates "
        f"every implementation step by step in one process; medians of {args.steps} timed steps after "
        f"{args.warmup} warm-up steps (their time, compilation included, in the last column). frugality ×: "
        f"frugality's tokens/s over the row's (on frugality's row: over the fastest peer's), with the "
        f"median and quartiles of the step-pair ratios.\n\n"
    )
    shapes = args.shapes.replace(",", "-")  # one file per set of shapes
    write_results(
        Path(__file__).parent / "results",
        "peers",
        f"{args.recipe}-{shapes}",
        header,
        markdown_table(rows),
        json.dumps(json.loads(rows_json(rows)), indent=1),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
