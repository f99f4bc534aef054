"""Contrastive training steps with and without the padding: the `minilm-pairs` recipe's
shape (all-MiniLM-L6-v2: 6 layers of 384, 64 WordNet pairs a step), eager, the same steps
timed alternately with the padding kept (every text padded to its step's bucket) and
skipped (`unpad`: the linear layers see the real tokens only; attention pads them back).
Losses are compared too. Written to
benchmarks/results/contrastive_step-minilm-pairs-<machine>-<date>.md and .json.

    .venv/bin/python benchmarks/contrastive_step.py [--steps 8] [--warmup 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from frugality.bench.results import machine_line, write_results
from frugality.config.recipe import load_recipe
from frugality.runtime.data import open_training_data
from frugality.runtime.layout import plan_layout
from frugality.runtime.state import build_state
from frugality.training.loop import train_step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    recipe = load_recipe("minilm-pairs", ["compile.level=O0", "train.precision=fp32"])
    data = open_training_data(recipe, progress=False)
    steps = [data.stream.next_step() for _ in range(args.warmup + args.steps)]
    states = {}
    for unpad in (False, True):
        state = build_state(plan_layout(recipe, torch.device("cpu")), data)
        state.task = state.task.configured(unpad=unpad)
        state.wrapped = state.task.training_module(state.model)  # the module that runs, with the setting
        states["skipped" if unpad else "kept"] = state
    seconds = {name: [] for name in states}
    losses = {name: [] for name in states}
    tokens = {name: 0 for name in states}
    for i, micro_batches in enumerate(steps):
        for name, state in states.items():
            t0 = time.perf_counter()
            loss, _, _ = train_step(state, micro_batches)
            if i >= args.warmup:
                seconds[name].append(time.perf_counter() - t0)
                tokens[name] += sum(int(b.mask.sum()) if name == "skipped" else b.ids.numel() for b in micro_batches)
            losses[name].append(loss)
    padded = tokens["kept"]
    rows = [
        {
            "padding": name,
            "step_s": round(statistics.median(ts), 3),
            "pairs_per_s": round(recipe.data.global_batch_size / statistics.median(ts), 1),
            "tokens_processed": tokens[name],
            "share_of_padded": round(tokens[name] / padded, 3),
            "speedup": round(statistics.median(seconds["kept"]) / statistics.median(ts), 3),
            "max_loss_difference": max(abs(a - b) for a, b in zip(losses[name], losses["kept"], strict=True)),
        }
        for name, ts in seconds.items()
    ]
    table = [
        "| padding | step (s, median) | pairs/s | tokens through the layers | vs padding kept | "
        "largest loss difference |",
        "|---|---|---|---|---|---|",
    ]
    table += [
        f"| {r['padding']} | {r['step_s']:.3f} | {r['pairs_per_s']:.1f} | {r['tokens_processed']:,} "
        f"({r['share_of_padded']:.0%}) | {r['speedup']:.2f}× | {r['max_loss_difference']:.1e} |"
        for r in rows
    ]
    header = (
        f"# Contrastive training steps, padding kept or skipped: minilm-pairs shape\n\n{machine_line()} "
        f"all-MiniLM-L6-v2's shape (random weights), {recipe.data.global_batch_size} WordNet pairs a step, "
        f"fp32, eager; the same {args.steps} steps for both after {args.warmup} warm-up, alternating; "
        f"medians.\n\n"
    )
    write_results(
        Path(__file__).parent / "results",
        "contrastive_step",
        "minilm-pairs",
        header,
        "\n".join(table),
        json.dumps(rows, indent=1),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
