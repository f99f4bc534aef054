"""XLA's CPU client against the CPU backend, eager and compiled: training tokens/s and cold
compile time, on this machine (`frugality.bench.xla`, which `frugality bench train --device
xla` runs too).

Each row is a fresh `frugality train` process with an empty compile cache (a cold start),
run from .venv-xla (torch 2.9.0 + torch-xla 2.9.0) so that every row has the same torch:
cpu eager (compile.level=O0), cpu compiled (O1, Inductor), and xla with PJRT_DEVICE=CPU
(XLA's CPU client). All in fp32 (what `auto` picks on XLA's CPU client). tiny at its
recipe's shape, Pythia-70m at batch 4 x 512.

    .venv-xla/bin/python benchmarks/xla.py [--recipes tiny,pythia-70m]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from frugality.bench.results import machine_line, write_results
from frugality.bench.xla import bench_xla, markdown_table

SHAPES = {  # timed steps (after two of warm-up), log interval (XLA reads the loss there), overrides
    "tiny": (24, 4, []),
    "pythia-70m": (12, 3, ["data.micro_batch_size=4", "data.global_batch_size=4", "data.seq_len=512"]),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default="tiny,pythia-70m")
    args = parser.parse_args()
    import os

    import torch_xla

    os.environ["PJRT_DEVICE"] = "CPU"  # this table is the CPU client's
    rows = []
    for recipe in args.recipes.split(","):
        steps, log_interval, shape = SHAPES[recipe]
        rows += bench_xla(recipe, shape, steps, log_interval, log=lambda line: print(line, file=sys.stderr))
    header = (
        f"# XLA's CPU client against the CPU backend, training, fp32\n\n"
        f"{machine_line()} torch-xla {torch_xla.__version__}.\n"
        f"Each row: a fresh `frugality train` process with an empty compile cache. tiny at its "
        f"recipe's shape ({SHAPES['tiny'][0]} steps after 2 of warm-up), Pythia-70m at batch 4 x 512 "
        f"({SHAPES['pythia-70m'][0]} after 2). tokens/s: the median over the logged records after the "
        f"warm-up (on XLA a record times the steps since the previous read of the loss, every log "
        f"interval; one holding a warm-up step is left out). compile s: "
        f"Inductor's compile time, or XLA's (CompileTime). warm-up s: each phase's first calls, "
        f"compiling and computing. What it does not say: anything about Trainium or TPU speed. "
        f"XLA's CPU client is a test bed for the XLA path (graph cuts, static shapes, no "
        f"recompilation, losses); its code generation is not tuned like the CPU backend's.\n\n"
    )
    write_results(
        Path(__file__).parent / "results",
        "xla",
        args.recipes.replace(",", "-"),
        header,
        markdown_table(rows),
        json.dumps(rows, indent=1),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
