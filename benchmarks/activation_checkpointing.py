"""Activation checkpointing's memory and time: a recipe's shape (default Pythia-70m at 4 x 512)
trained a few steps under each mode (none, selective, full) and precision, each run in a
fresh process of its own so that its peak is its own (`frugality.metrics.memory`: the
process's VmHWM on a CPU, the allocator's peak on a GPU).

Columns: the peak; the training state (weights, gradients, optimizer moments: what the
modes share); the process before the state was built (imports, the runtime); the rest, peak
less both: what the step adds, activations first; what the plan predicts for the
activations; the median step; the losses, which must be the same bits in every mode.

    .venv/bin/python benchmarks/activation_checkpointing.py [--recipe pythia-70m] [--batch 4] [--seq 512]
        [--precisions fp32,bf16-sr] [--steps 5] [--level O1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from frugality.bench.results import machine_line, write_results

MODES = ("none", "selective", "full")


def child_compiled(recipe_name: str, precision: str, mode: str, batch: int, seq: int, steps: int, level: str) -> dict:
    """The same steps compiled at `level`, as `bench train` runs frugality (its compile
    session; the first two steps are the warm-up and compile): their time, not their memory
    (the compiler's own allocations land in the peak)."""
    import contextlib

    from frugality.bench.train import make_runner
    from frugality.config.recipe import load_recipe

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    recipe = load_recipe(recipe_name, [f"train.activation_checkpointing={mode}", f"compile.level={level}"])
    g = torch.Generator().manual_seed(0)
    losses, times = [], []
    with contextlib.ExitStack() as stack:
        step = make_runner("frugality", recipe, precision, device, batch, seq, stack)[0]
        for _ in range(steps):
            tokens = torch.randint(0, recipe.model.vocab_size, (batch, seq + 1), generator=g).to(device)
            started = time.perf_counter()
            loss = step(tokens)
            assert loss is not None  # (read every step here)
            losses.append(float(loss))
            times.append(time.perf_counter() - started)
    return {
        "precision": precision,
        "mode": mode,
        "level": level,
        "warmup_s": round(sum(times[:2]), 1),
        "median_step_s": round(statistics.median(times[2:]), 4),
        "losses": losses,
    }


def child(recipe_name: str, precision: str, mode: str, batch: int, seq: int, steps: int) -> dict:
    from dataclasses import replace

    from frugality.bench.train import for_shape
    from frugality.config.recipe import load_recipe
    from frugality.metrics.memory import peak_memory_bytes, training_state_bytes
    from frugality.runtime.host_memory import give_back_freed_memory, keep_freed_memory
    from frugality.runtime.layout import plan_layout
    from frugality.runtime.plan import plan_memory
    from frugality.runtime.state import build_state

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and mode == "none":
        keep_freed_memory()  # as `frugality train` runs (not under a checkpointing mode: memory was asked for)
    recipe = for_shape(
        load_recipe(recipe_name, [f"train.activation_checkpointing={mode}", "compile.level=O0"]), precision, batch, seq
    )
    before = peak_memory_bytes(device) or 0
    state = build_state(replace(plan_layout(recipe, device, fit=False), checkpointing=(mode, "asked for")))
    g = torch.Generator().manual_seed(0)
    losses, times = [], []
    for _ in range(steps):
        tokens = torch.randint(0, recipe.model.vocab_size, (batch, seq + 1), generator=g).to(device)
        started = time.perf_counter()
        with state.autocast:
            loss = state.wrapped(tokens)
        loss.backward()
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
        if device.type == "cpu" and mode != "none":
            give_back_freed_memory()  # as `frugality train` does after a step under a checkpointing mode
        losses.append(loss.item())  # (a device synchronisation: the clock stops after the step's work)
        times.append(time.perf_counter() - started)
    planned = plan_memory(recipe, 1, "ddp", policy=state.policy, fused_output=True, checkpointing=mode)
    return {
        "precision": state.policy.name,
        "mode": mode,
        "peak_bytes": peak_memory_bytes(device),
        "state_bytes": training_state_bytes(state.model, state.optimizer),
        "before_bytes": before,
        "planned_activation_bytes": planned.activations,
        "median_step_s": round(statistics.median(times[1:] or times), 4),
        "losses": losses,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="pythia-70m")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--precisions", default="fp32,bf16-sr")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--level", default="O0", help="O1: also time each mode compiled (a table of its own)")
    parser.add_argument("--child", nargs=3, metavar=("PRECISION", "MODE", "RECIPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        precision, mode, recipe = args.child
        if args.level != "O0":
            print(json.dumps(child_compiled(recipe, precision, mode, args.batch, args.seq, args.steps, args.level)))
        else:
            print(json.dumps(child(recipe, precision, mode, args.batch, args.seq, args.steps)))
        return 0
    if args.level != "O0":
        return compiled_table(args)
    rows = _runs(args)
    mib = 2**20
    lines = [
        "| precision | activation checkpointing | peak (MiB) | training state (MiB) | before the state (MiB) "
        "| peak less both (MiB) | of none's | plan's activations (MiB) | median step (s) | of none's "
        "| losses as none's |",
        "|" + "---|" * 11,
    ]
    for row in rows:
        base = next(r for r in rows if r["precision"] == row["precision"] and r["mode"] == "none")
        rest = row["peak_bytes"] - row["state_bytes"] - row["before_bytes"]
        base_rest = base["peak_bytes"] - base["state_bytes"] - base["before_bytes"]
        row["peak_less_state_bytes"] = rest
        same = "the same bits" if row["losses"] == base["losses"] else "differ"
        lines.append(
            f"| {row['precision']} | {row['mode']} | {row['peak_bytes'] / mib:,.0f} | {row['state_bytes'] / mib:,.0f} "
            f"| {row['before_bytes'] / mib:,.0f} | {rest / mib:,.0f} | {rest / base_rest:.0%} "
            f"| {row['planned_activation_bytes'] / mib:,.0f} | {row['median_step_s']:.3f} "
            f"| {row['median_step_s'] / base['median_step_s']:.2f}× | {same} |"
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    header = (
        f"# Activation checkpointing: memory and time\n\n{machine_line()} {args.recipe} at {args.batch} x "
        f"{args.seq}, {args.steps} steps a run ({device}, eager), each run a fresh process; peaks are the "
        "process's (VmHWM) on a CPU.\n\n"
    )
    write_results(
        Path(__file__).parent / "results",
        "activation_checkpointing",
        args.recipe,
        header,
        "\n".join(lines),
        json.dumps(rows, indent=1),
    )
    return 0


def _runs(args) -> list[dict]:
    """Each precision and mode in a fresh process of its own (`--child`), with caches of its
    own (compiled: nothing compiled before, each mode compiles); their rows."""
    rows = []
    for precision in args.precisions.split(","):
        for mode in MODES:
            command = [sys.executable, __file__, "--batch", str(args.batch), "--seq", str(args.seq), "--level"]
            command += [args.level, "--steps", str(args.steps), "--child", precision, mode, args.recipe]
            with tempfile.TemporaryDirectory() as cache:
                env = os.environ | {"FRUGALITY_CACHE": cache, "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor"}
                done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"{precision} {mode} {args.level}: done", file=sys.stderr)
    return rows


def compiled_table(args) -> int:
    rows = _runs(args)
    lines = [
        "| precision | activation checkpointing | compile | warm-up, 2 steps (s) | median step (s) | of none's "
        "| losses as none's |",
        "|" + "---|" * 7,
    ]
    for row in rows:
        base = next(r for r in rows if r["precision"] == row["precision"] and r["mode"] == "none")
        same = "the same bits" if row["losses"] == base["losses"] else "differ"
        lines.append(
            f"| {row['precision']} | {row['mode']} | {row['level']} | {row['warmup_s']} | {row['median_step_s']:.3f} "
            f"| {row['median_step_s'] / base['median_step_s']:.2f}× | {same} |"
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    header = (
        f"# Activation checkpointing: time compiled\n\n{machine_line()} {args.recipe} at {args.batch} x "
        f"{args.seq}, {args.steps} steps a run ({device}, compile.level {args.level}: the blocks compiled, the "
        "first two steps their warm-up), each run a fresh process with an empty Inductor cache of its own.\n\n"
    )
    write_results(
        Path(__file__).parent / "results",
        "activation_checkpointing",
        f"{args.recipe}-{args.level.lower()}",
        header,
        "\n".join(lines),
        json.dumps(rows, indent=1),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
