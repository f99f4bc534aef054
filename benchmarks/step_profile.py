"""Where a training step's time goes, frugality against its peers, by kind of work (the
torch profiler's op events in categories: the output layer's and the blocks' matrix
products, attention, loss, optimizer, compiled kernels, elementwise, outside ops). One
table per batch shape, written to benchmarks/results/step_profile-<recipe>-<shape>-<machine>-<date>.md
and .json. Precision: the machine's best class, as benchmarks/peers.py picks it.

    .venv/bin/python benchmarks/step_profile.py [--recipe pythia-70m] [--level O1] [--shapes 4x512,16x512]
        [--impls frugality,transformers-compiled,litgpt,transformers] [--steps 2] [--warmup 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from frugality.bench.profile import markdown_table, profile_steps, rows_json
from frugality.bench.results import machine_line, write_results
from frugality.bench.train import for_shape
from frugality.config.recipe import load_recipe
from frugality.hardware import probe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="pythia-70m")
    parser.add_argument("--level", default="O1", help="frugality's compile level")
    parser.add_argument("--shapes", default="4x512,16x512")
    parser.add_argument("--impls", default="frugality,transformers-compiled,litgpt,transformers")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ours, theirs = ("bf16-sr", "amp-bf16") if probe(device).native_bf16 else ("fp32", "fp32")
    recipe = load_recipe(args.recipe, [f"compile.level={args.level}"])
    for shape in args.shapes.split(","):
        batch, seq = (int(x) for x in shape.split("x"))
        rows = []
        for impl in args.impls.split(","):
            precision = ours if impl == "frugality" else theirs
            rows.append(
                profile_steps(
                    for_shape(recipe, precision, batch, seq),
                    impl,
                    precision,
                    batch,
                    seq,
                    args.steps,
                    args.warmup,
                    log=lambda s: print(s, file=sys.stderr),
                )
            )
        header = (
            f"# Where a training step's time goes, {args.recipe} architecture, {batch} x {seq}\n\n"
            f"{machine_line()} frugality at {args.level}. torch profiler, {args.steps} steps after "
            f"{args.warmup} warm-up steps, one implementation at a time; each op's self time in one "
            f"category (`frugality.bench.profile`), seconds per step and share of the step.\n\n"
        )
        write_results(
            Path(__file__).parent / "results",
            "step_profile",
            f"{args.recipe}-{shape}",
            header,
            markdown_table(rows),
            rows_json(rows),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
