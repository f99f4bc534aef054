"""Quality of each precision policy against fp32 on the `tiny` recipe: the same seed,
data and steps; loss and gradient-norm trajectories compared step by step.

    .venv/bin/python benchmarks/precision_quality.py [--recipe tiny] [--set KEY=VALUE ...]

Writes benchmarks/results/precision_quality-<recipe>-<machine>-<date>.md.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
import tempfile
from pathlib import Path

import torch

from frugality.config.recipe import load_recipe
from frugality.hardware import device_name
from frugality.metrics.compare import compare_runs
from frugality.training.trainer import train


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--precision", default="amp-bf16,bf16-sr,bf16")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in ["fp32", *args.precision.split(",")]:
            recipe = load_recipe(args.recipe, [*args.overrides, f"train.precision={precision}"])
            result = train(recipe, run_dir=Path(tmp) / precision, progress=False, tensorboard=False)
            runs[precision] = result.summary
            print(
                f"{precision}: val loss {result.summary['final_val_loss']:.4f}, "
                f"{result.summary['median_tokens_per_s']:.0f} tokens/s",
                file=sys.stderr,
            )
        lines = [
            "| precision | final val loss | vs fp32 | max \\|Δ train loss\\| | mean \\|Δ grad norm\\| / fp32 "
            "| tokens/s | state bytes/param |",
            "|---|---|---|---|---|---|---|",
        ]
        for precision, summary in runs.items():
            c = compare_runs(Path(tmp) / "fp32", Path(tmp) / precision)
            lines.append(
                f"| {precision} | {summary['final_val_loss']:.4f} | {c.final_val_rel_diff:+.2%} | "
                f"{c.max_abs_loss_diff:.4f} | {c.mean_rel_grad_norm_diff:.2%} | "
                f"{summary['median_tokens_per_s']:,.0f} | {summary['memory']['bytes_per_param']:g} |"
            )
    recipe = load_recipe(args.recipe, args.overrides)
    machine = device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    date = datetime.date.today().isoformat()
    text = (
        f"# Precision policies against fp32, `{args.recipe}` recipe ({recipe.train.steps} steps)\n\n"
        f"Machine: {machine}; torch {torch.__version__}; {date}. Same seed, data order and "
        f"steps for every policy; Δ are per-step differences from the fp32 run.\n\n" + "\n".join(lines) + "\n"
    )
    slug = re.sub(r"[^a-z0-9]+", "-", machine.lower()).strip("-")
    out = Path(__file__).parent / "results" / f"precision_quality-{args.recipe}-{slug}-{date}.md"
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
