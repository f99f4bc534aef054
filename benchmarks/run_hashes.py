"""Hashes of short runs' losses and final weights, to show a refactor changed nothing.

Trains 16 fp32 steps of `tiny`, `minilm-pairs` (16 pairs a step) and `bert-mlm`, and 16
bf16-sr steps of `tiny` (its own rounding kernels, BF16AdamW), in one process into a scratch
folder, then prints, per recipe, a hash of every train and eval loss
(as logged) and a hash of the last checkpoint's weights. Run it before and after a change:
equal hashes mean bit-identical training.

    .venv/bin/python benchmarks/run_hashes.py [--out /tmp/hashes]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path

import torch

from frugality.checkpoint import CheckpointManager
from frugality.config.recipe import load_recipe
from frugality.models import build_model
from frugality.precision import get_policy
from frugality.runtime.optim import build_optimizer
from frugality.tasks import freeze_unused, get_task
from frugality.training import trainer

SHORT = [
    "train.precision=fp32",
    "train.steps=16",
    "optim.warmup_steps=2",
    "train.eval_interval=8",
    "train.save_interval=16",
]
RUNS = [  # (label, recipe, overrides)
    ("tiny", "tiny", SHORT),
    ("minilm-pairs", "minilm-pairs", [*SHORT, "data.global_batch_size=16", "data.micro_batch_size=8"]),
    ("bert-mlm", "bert-mlm", SHORT),
    ("tiny bf16-sr", "tiny", [*SHORT, "train.precision=bf16-sr"]),
]


def run_hashes(out: Path) -> list[dict]:
    rows = []
    for label, name, sets in RUNS:
        recipe = load_recipe(name, sets)
        run = out / label.replace(" ", "-")
        trainer.train(recipe, run_dir=run, fresh=True, progress=False, tensorboard=False)
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses = [(r["step"], r["kind"], r.get("loss")) for r in records if r["kind"] in ("train", "eval")]
        model = get_policy(recipe.train.precision).prepare_model(build_model(recipe.model))  # (bf16 weights too)
        freeze_unused(get_task(recipe.train.task), model)
        checkpoints = CheckpointManager(run / "checkpoints")
        policy = get_policy(recipe.train.precision)
        latest = checkpoints.latest()
        assert latest is not None  # (saved at step 16)
        checkpoints.load(latest, model, build_optimizer(model, recipe.optim, policy))
        weights = hashlib.sha256()
        for key, value in sorted(model.state_dict().items()):
            weights.update(key.encode())
            weights.update(value.detach().contiguous().view(torch.uint8).numpy().tobytes())  # (bf16's bits too)
        rows.append(
            {
                "recipe": label,
                "losses": hashlib.sha256(json.dumps(losses).encode()).hexdigest()[:16],
                "weights": weights.hexdigest()[:16],
                "final_val_loss": losses[-1][2],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="where the runs go [default: a temporary folder]")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        rows = run_hashes(args.out or Path(scratch))
    print("| recipe | losses (sha256, 16 hex) | weights (sha256, 16 hex) | final val loss |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['recipe']} | {r['losses']} | {r['weights']} | {r['final_val_loss']:.6f} |")


if __name__ == "__main__":
    main()
