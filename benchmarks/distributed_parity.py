"""Quality parity across world sizes: a recipe trained in one process and on N processes
(each strategy), compared step by step. Written to benchmarks/results/
distributed_parity-<recipe>-<machine>-<date>.md and .json.

    .venv/bin/python benchmarks/distributed_parity.py [--recipe tiny] [--precision bf16-sr] [--nproc 2]
        [--strategy ddp,fsdp]

Every run is `frugality train --nproc N` with the recipe's global batch in micro-batches of
global / N (each rank takes one a step; one process accumulates N); threads split between
the ranks. The bar (distributed issue): the
final losses within 1% of one process's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from frugality.bench.results import machine_line, write_results
from frugality.config.recipe import load_recipe


def train(
    recipe: str, precision: str, nproc: int, strategy: str, run_dir: Path, micro: int
) -> dict[str, dict[int, float]]:
    threads = max(
        1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)) // nproc
    )
    command = [
        sys.executable,
        "-m",
        "frugality",
        "train",
        recipe,
        "--run-dir",
        str(run_dir),
        "--no-progress",
        "--nproc",
        str(nproc),
        "--set",
        f"train.precision={precision}",
        "--set",
        f"parallel.data={strategy}",
        "--set",
        f"data.micro_batch_size={micro}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": str(threads)})
    if done.returncode != 0:
        raise SystemExit(f"{strategy} x{nproc} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {kind: {r["step"]: r["loss"] for r in records if r["kind"] == kind} for kind in ("train", "eval")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--precision", default="bf16-sr")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--strategy", default="ddp,fsdp")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="frugality-parity-") as scratch:
        micro = load_recipe(args.recipe).data.global_batch_size // args.nproc  # one process accumulates
        one = train(args.recipe, args.precision, 1, "ddp", Path(scratch) / "one", micro)
        last = max(one["train"])
        for strategy in args.strategy.split(","):
            many = train(args.recipe, args.precision, args.nproc, strategy, Path(scratch) / strategy, micro)
            steps = sorted(one["train"])
            worst = max(abs(many["train"][s] / one["train"][s] - 1) for s in steps)
            rows.append(
                {
                    "strategy": strategy,
                    "nproc": args.nproc,
                    "precision": args.precision,
                    "steps": last,
                    "final_train_one": one["train"][last],
                    "final_train_many": many["train"][last],
                    "final_eval_one": one["eval"][last],
                    "final_eval_many": many["eval"][last],
                    "final_eval_difference": many["eval"][last] / one["eval"][last] - 1,
                    "largest_step_difference": worst,
                }
            )
            print(
                f"{strategy} x{args.nproc}: final eval {many['eval'][last]:.4f} vs {one['eval'][last]:.4f}",
                file=sys.stderr,
            )
    lines = [
        "| strategy | ranks | precision | steps | final train loss, 1 process / N | final validation loss, "
        "1 process / N | validation difference | largest per-step train difference |",
        "|" + "---|" * 8,
    ]
    for r in rows:
        lines.append(
            f"| {r['strategy']} | {r['nproc']} | {r['precision']} | {r['steps']} | "
            f"{r['final_train_one']:.4f} / {r['final_train_many']:.4f} | {r['final_eval_one']:.4f} / "
            f"{r['final_eval_many']:.4f} | {r['final_eval_difference']:+.3%} | "
            f"{r['largest_step_difference']:.3%} |"
        )
    header = (
        f"# Quality parity across world sizes, {args.recipe} recipe, {args.precision}\n\n{machine_line()}\n"
        f"One process against {args.nproc} (`frugality train --nproc`), the same global batch; the bar is "
        "1% on the final losses.\n\n"
    )
    write_results(
        Path(__file__).parent / "results",
        "distributed_parity",
        args.recipe,
        header,
        "\n".join(lines),
        json.dumps(rows, indent=1),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
