"""The fault-injection suite: each fault a production run meets, injected into a real
`frugality train --retries` run on 1 process and on N over gloo, and what it cost. Written to
benchmarks/results/faults-<recipe>-<machine>-<date>.md and .json.

    .venv/bin/python benchmarks/faults.py [--nproc 2] [--steps 12]

The recipe is a micro model (2 layers of width 32, the bundled corpus, fp32, a checkpoint
every 4 steps, `train.step_timeout_s` for the hang). For each world size: one uninterrupted
run, then one run per fault (`FRUGALITY_INJECT_FAULT`, frugality.training.callbacks.faults),
supervised with `--retries 2` and no back-off. A fault whose exit the supervisor leaves to
the operator by design — a full disk (exit 2: space must be freed) and a preemption (exit
130: the scheduler requeues) — is followed by the same command once more, as they would.
Each row: whether the run completed, whether its final model and optimizer state are
bit-identical to the uninterrupted run's (for the NaN, to a second run with the same NaN:
a skipped step changes the trajectory by design), the attempts, the steps recomputed and
the wall time lost against the uninterrupted run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from frugality.bench.results import machine_line, write_results

RECIPE = """
name = "faults"
seed = 7
[model]
family = "gpt-neox"
hidden_size = 32
num_layers = 2
num_heads = 4
vocab_size = 50304
max_seq_len = 64
[data]
dataset = "bundled:gutenberg"
tokenizer = "pythia"
seq_len = 32
global_batch_size = 4
micro_batch_size = 2
[optim]
lr = 1e-2
min_lr = 1e-3
warmup_steps = 2
[train]
precision = "fp32"
steps = {steps}
eval_interval = 4
eval_samples = 4
save_interval = 4
keep_checkpoints = 3
step_timeout_s = 15
"""

# (fault, what it is); the step and rank are filled in per world size
FAULTS = [
    ("kill@6:{last}", "SIGKILL of the last rank after step 6, before its checkpoint"),
    ("kill_in_save@8:{last}", "SIGKILL of the last rank while the step-8 checkpoint is written"),
    ("truncate@8", "the newest checkpoint (step 8) cut in half, then the run killed"),
    ("nan@6", "a NaN in every gradient of step 6"),
    ("hang@6:{last}", "the last rank hung for good in step 6"),
    ("enospc@8", "no space left on the device when the step-8 checkpoint is written"),
    ("sigterm@6", "SIGTERM (preemption) after step 6"),
]
RERUN_BY_OPERATOR = {2: "operator frees space, reruns", 130: "scheduler requeues"}


def run(recipe: Path, run_dir: Path, nproc: int, fault: str | None) -> tuple[int, float, str]:
    env = os.environ | {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    env.pop("FRUGALITY_INJECT_FAULT", None)
    if fault:
        env["FRUGALITY_INJECT_FAULT"] = fault
    command = [
        sys.executable,
        "-m",
        "frugality",
        "train",
        str(recipe),
        "--run-dir",
        str(run_dir),
        "--no-progress",
        "--nproc",
        str(nproc),
        "--retries",
        "2",
        "--set",
        "train.retry_backoff_s=0",
    ]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    return done.returncode, time.perf_counter() - start, done.stderr


def final_state_digest(recipe_file: Path, run_dir: Path) -> str:
    """SHA-256 over the final checkpoint's model and optimizer tensors, loaded in one process."""
    import torch

    from frugality.checkpoint import CheckpointManager
    from frugality.config.recipe import load_recipe
    from frugality.models import build_model
    from frugality.runtime.optim import build_optimizer

    recipe = load_recipe(str(recipe_file))
    model = build_model(recipe.model)
    optimizer = build_optimizer(model, recipe.optim)
    manager = CheckpointManager(run_dir / "checkpoints")
    latest = manager.latest()
    if latest is None or latest.name != f"step_{recipe.train.steps:08d}":
        return "incomplete"
    manager.load(latest, model, optimizer)
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode() + tensor.numpy().tobytes())
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            digest.update(f"{index}.{key}".encode() + (value.numpy().tobytes() if torch.is_tensor(value) else b""))
    return digest.hexdigest()


def attempts_of(run_dir: Path) -> list[dict]:
    path = run_dir / "attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="frugality-faults-") as scratch:
        scratch = Path(scratch)
        recipe = scratch / "faults.toml"
        recipe.write_text(RECIPE.format(steps=args.steps))
        for nproc in sorted({1, args.nproc}):
            run(recipe, scratch / f"warm-{nproc}", nproc, None)  # caches (tokenized corpus, kernels) filled
            status, reference_s, err = run(recipe, scratch / f"ref-{nproc}", nproc, None)
            if status != 0:
                raise SystemExit(f"the uninterrupted run on {nproc} process(es) failed:\n{err[-3000:]}")
            reference = final_state_digest(recipe, scratch / f"ref-{nproc}")
            for spec, what in FAULTS:
                fault = spec.format(last=nproc - 1)
                run_dir = scratch / f"{fault.replace('@', '-').replace(':', '-')}-{nproc}"
                status, wall, err = run(recipe, run_dir, nproc, fault)
                causes = [a["cause"] for a in attempts_of(run_dir)]
                recomputed = sum(a["recomputed_steps"] for a in attempts_of(run_dir))
                operator = RERUN_BY_OPERATOR.get(status)
                if operator:  # the fault fired once; the same command again, as the operator would
                    status, again, err = run(recipe, run_dir, nproc, fault)
                    wall += again
                    causes += [a["cause"] for a in attempts_of(run_dir)]  # the supervisor's file is per command
                    recomputed += sum(a["recomputed_steps"] for a in attempts_of(run_dir))
                if status != 0:
                    print(err[-2000:], file=sys.stderr)
                digest = final_state_digest(recipe, run_dir) if status == 0 else "failed"
                if fault.startswith("nan"):
                    again_dir = run_dir.with_name(run_dir.name + "-again")
                    run(recipe, again_dir, nproc, fault)
                    identical = digest == final_state_digest(recipe, again_dir)
                    compared = "a second run with the same NaN"
                else:
                    identical = digest == reference
                    compared = "the uninterrupted run"
                rows.append(
                    {
                        "nproc": nproc,
                        "fault": fault,
                        "what": what,
                        "completed": status == 0,
                        "bit_identical": identical,
                        "compared_with": compared,
                        "attempts": causes,
                        "operator": operator or "",
                        "recomputed_steps": recomputed,
                        "wall_s": round(wall, 1),
                        "reference_s": round(reference_s, 1),
                        "lost_s": round(wall - reference_s, 1),
                    }
                )
                print(
                    f"{nproc} proc, {fault}: completed={status == 0} identical={identical} "
                    f"lost {wall - reference_s:.1f} s; {' / '.join(causes)}",
                    file=sys.stderr,
                )
    lines = [
        "| ranks | fault | completed | bit-identical | attempts (how each ended) | rerun outside | "
        "steps recomputed | wall s (uninterrupted) | time lost s |",
        "|" + "---|" * 9,
    ]
    for r in rows:
        lines.append(
            f"| {r['nproc']} | `{r['fault']}`: {r['what']} | {'yes' if r['completed'] else 'NO'} | "
            f"{'yes' if r['bit_identical'] else 'NO'} (vs {r['compared_with']}) | "
            f"{'; '.join(r['attempts'])} | {r['operator'] or '-'} | {r['recomputed_steps']} | "
            f"{r['wall_s']} ({r['reference_s']}) | "
            f"{r['lost_s']} |"
        )
    survived = sum(r["completed"] and r["bit_identical"] for r in rows)
    header = (
        f"# Fault-injection suite, {args.steps}-step micro recipe\n\n{machine_line()}\n"
        f"`frugality train --retries 2` (no back-off) on 1 and {args.nproc} processes (gloo), a checkpoint "
        f"every 4 steps, `train.step_timeout_s = 15`. {survived} of {len(rows)} runs completed "
        "bit-identical to their reference. Time lost: wall time of the faulted run (every attempt, "
        "and the operator's rerun where there is one) minus the uninterrupted run's.\n\n"
    )
    write_results(
        Path(__file__).parent / "results", "faults", "micro", header, "\n".join(lines), json.dumps(rows, indent=1)
    )
    print("\n".join(lines))
    return 0 if survived == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
