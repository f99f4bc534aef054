"""Asynchronous checkpoints against synchronous ones: how much of a save's time training gets
back. Written to benchmarks/results/async_checkpoint-<recipe>-<machine>-<date>.md and .json.

    .venv/bin/python benchmarks/async_checkpoint.py [--recipe tiny] [--steps 40] [--every 5] [--repeats 2]

Each run is `frugality train RECIPE` with a checkpoint every `--every` steps and no
evaluation but the first and last; synchronous and asynchronous runs alternate `--repeats`
times. The wall time (from the first step to the summary, the last checkpoint written
synchronously in both) and the median step time are taken from each run's summary.json;
the table gives the median of the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from frugality.bench.results import machine_line, write_results


def run(recipe: str, steps: int, every: int, asynchronous: bool, run_dir: Path) -> dict:
    command = [
        sys.executable,
        "-m",
        "frugality",
        "train",
        recipe,
        "--run-dir",
        str(run_dir),
        "--no-progress",
        "--set",
        f"train.steps={steps}",
        "--set",
        f"train.save_interval={every}",
        "--set",
        f"train.eval_interval={steps}",
        "--set",
        f"train.keep_checkpoints={steps // every + 1}",
        "--set",
        f"train.async_checkpoint={str(asynchronous).lower()}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        raise SystemExit(f"{'async' if asynchronous else 'sync'} run failed:\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    size = sum(f.stat().st_size for f in (run_dir / "checkpoints" / checkpoints[-1]).iterdir())
    return {
        "wall_s": summary["wall_time_s"],
        "train_s": summary["train_time_s"],
        "median_step_s": summary["median_step_time_s"],
        "checkpoints": len(checkpoints),
        "bytes": size,
        "final_train_loss": summary["final_train_loss"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="frugality-async-") as scratch:
        run(args.recipe, args.steps, args.steps, False, Path(scratch) / "warm")  # caches filled, not timed
        for i in range(args.repeats):
            for asynchronous in (False, True):
                r = run(args.recipe, args.steps, args.every, asynchronous, Path(scratch) / f"{asynchronous}-{i}")
                results[asynchronous].append(r)
                print(f"{'async' if asynchronous else 'sync '} {i}: {r}", file=sys.stderr)
    rows = []
    for asynchronous, runs in results.items():
        rows.append(
            {
                "mode": "asynchronous" if asynchronous else "synchronous",
                "wall_s": statistics.median(r["wall_s"] for r in runs),
                "train_s": statistics.median(r["train_s"] for r in runs),
                "median_step_s": statistics.median(r["median_step_s"] for r in runs),
                "checkpoints": runs[0]["checkpoints"],
                "checkpoint_mib": runs[0]["bytes"] / 2**20,
                "final_train_loss": runs[0]["final_train_loss"],
                "runs": runs,
            }
        )
    sync, asyn = rows
    saved = sync["wall_s"] - asyn["wall_s"]
    lines = [
        "| checkpoints | wall time s | time in steps s | median step s | wall time outside steps s | "
        "final train loss |",
        "|" + "---|" * 6,
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']}: {r['checkpoints']} of {r['checkpoint_mib']:.0f} MiB | {r['wall_s']:.2f} | "
            f"{r['train_s']:.2f} | {r['median_step_s']:.4f} | {r['wall_s'] - r['train_s']:.2f} | "
            f"{r['final_train_loss']:.4f} |"
        )
    header = (
        f"# Asynchronous checkpoints, {args.recipe} recipe\n\n{machine_line()}\n"
        f"{args.steps} steps, a checkpoint every {args.every} (the last one synchronous in both), "
        f"median of {args.repeats} alternating runs. Wall time asynchronous against synchronous: "
        f"{-saved:+.2f} s of {sync['wall_s']:.2f} s ({-saved / sync['wall_s']:+.1%}); equal final "
        "losses: the background writes leave training as it was.\n\n"
    )
    write_results(
        Path(__file__).parent / "results",
        "async_checkpoint",
        args.recipe,
        header,
        "\n".join(lines),
        json.dumps(rows, indent=1),
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
