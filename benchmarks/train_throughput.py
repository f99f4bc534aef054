"""Training throughput: frugality vs transformers' GPTNeoXForCausalLM + torch AdamW.

Pythia-70m architecture, batch 4 x 512 tokens, every precision policy, both
implementations alternating step by step in one process (medians of the timed steps),
peak memory from a fresh subprocess per implementation. Writes a Markdown table and the
JSON rows to benchmarks/results/, named by model, machine and date.

    .venv/bin/python benchmarks/train_throughput.py [--steps 5] [--warmup 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from frugality.bench.train import bench_train, markdown_table, rows_json
from frugality.bench.results import machine_line, write_results
from frugality.config.recipe import load_recipe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="pythia-70m")
    parser.add_argument("--precision", default="fp32,amp-bf16,bf16-sr,bf16")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    recipe = load_recipe(args.recipe)
    rows = bench_train(recipe, args.precision.split(","), args.batch, args.seq, args.steps,
                       args.warmup, log=lambda line: print(line, file=sys.stderr))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    header = (
        f"# Training throughput, {args.recipe} architecture, batch {args.batch} x {args.seq}\n\n"
        f"{machine_line()}\n"
        f"frugality and transformers alternate step by step in one process; medians of "
        f"{args.steps} timed steps after {args.warmup} warm-up steps. MFU against the "
        f"measured matmul peak of the compute dtype (fp32 for fp32, bf16 otherwise). "
        f"Peak memory: a fresh process training two steps of one implementation "
        f"({'allocator peak' if device.type == 'cuda' else 'peak resident set'}).\n\n"
    )
    write_results(Path(__file__).parent / "results", "train_throughput", args.recipe, header,
                  markdown_table(rows), rows_json(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
