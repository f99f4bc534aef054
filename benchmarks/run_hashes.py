"""Hashes of short runs' losses and final weights, to show a refactor changed nothing.

Trains 16 fp32 steps of `tiny`, `minilm-pairs` (16 pairs a step) and `bert-mlm` in one
process into a scratch folder, then prints, per recipe, a hash of every train and eval loss
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

from frugality.checkpoint import CheckpointManager
from frugality.config.recipe import load_recipe
from frugality.models import build_model
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
RUNS = [
    ("tiny", SHORT),
    ("minilm-pairs", [*SHORT, "data.global_batch_size=16", "data.micro_batch_size=8"]),
    ("bert-mlm", SHORT),
]


def run_hashes(out: Path) -> list[dict]:
    rows = []
    for name, sets in RUNS:
        recipe = load_recipe(name, sets)
        run = out / name
        trainer.train(recipe, run_dir=run, fresh=True, progress=False, tensorboard=False)
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses = [(r["step"], r["kind"], r.get("loss")) for r in records if r["kind"] in ("train", "eval")]
        model = build_model(recipe.model)
        freeze_unused(get_task(recipe.train.task), model)
        checkpoints = CheckpointManager(run / "checkpoints")
        checkpoints.load(checkpoints.latest(), model, build_optimizer(model, recipe.optim))
        weights = hashlib.sha256()
        for key, value in sorted(model.state_dict().items()):
            weights.update(key.encode())
            weights.update(value.detach().contiguous().numpy().tobytes())
        rows.append(
            {
                "recipe": name,
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
