"""Compile levels: cold compile time, warm-start time to the first step, tokens/s.

Pythia-70m architecture, batch 4 x 512 tokens, every precision policy and compile level.
Each (precision, level) runs in two fresh processes: a cold one with an empty cache, then a
warm one with empty temporary and Inductor directories that fetches what the cold one
published from the cache URL (a fresh local directory; --cache s3://... to go through S3).
Writes a Markdown table and the JSON rows to benchmarks/results/, named by model, machine
and date.

    .venv/bin/python benchmarks/compile_levels.py [--steps 5] [--level O0,O1,O2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from frugality.bench.compile import bench_compile, markdown_table, rows_from_json, rows_json
from frugality.bench.results import machine_line, write_results
from frugality.config.recipe import load_recipe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="pythia-70m")
    parser.add_argument("--precision", default="fp32,amp-bf16,bf16-sr,bf16")
    parser.add_argument("--level", default="O0,O1,O2")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cache", help="cache URL [default: a fresh temporary directory per level]")
    parser.add_argument("--from-json", help="re-render the table of an earlier run's JSON rows")
    args = parser.parse_args()

    if args.from_json:
        rows = rows_from_json(Path(args.from_json).read_text())
    else:
        rows = bench_compile(
            load_recipe(args.recipe),
            args.precision.split(","),
            args.level.split(","),
            args.batch,
            args.seq,
            steps=args.steps,
            cache=args.cache,
            log=lambda line: print(line, file=sys.stderr, flush=True),
        )
    header = (
        f"# Compile levels, {args.recipe} architecture, batch {args.batch} x {args.seq}\n\n"
        f"{machine_line()}\n"
        f"Cold: a fresh process with an empty cache. Warm: a fresh process with empty temporary "
        f"and Inductor directories, fetching the cold run's entry from the cache URL. Compile: "
        f"seconds in dynamo, AOTAutograd and Inductor as they report it (warm: tracing and "
        f"loading from the cache). First step: seconds from process launch to the end of the "
        f"first training step (interpreter start, imports, model build, cache fetch and load, "
        f"the step itself); the warm start's overhead is its first step minus the eager (O0) "
        f"process's first step. Tokens/s: median of "
        f"{args.steps} steps of the warm process, which alternates them with steps of an eager "
        f"copy of the model (the speed-up column). Recompiles: compilations after warm-up, "
        f"both processes.\n\n"
    )
    write_results(
        Path(__file__).parent / "results", "compile_levels", args.recipe, header, markdown_table(rows), rows_json(rows)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
