"""XLA's CPU client against the CPU backend, eager and compiled: training tokens/s and cold
compile time, on this machine.

Each row is a fresh `frugality train` process with an empty compile cache (a cold start),
run from .venv-xla (torch 2.9.0 + torch-xla 2.9.0) so that every row has the same torch:
- cpu eager: train.device=cpu, compile.level=O0;
- cpu compiled: train.device=cpu, compile.level=O1 (Inductor);
- xla: train.device=xla with PJRT_DEVICE=CPU (XLA's CPU client).
All in fp32 (what `auto` picks on XLA's CPU client). tiny at its recipe's shape, Pythia-70m
at batch 4 x 512. Figures from each run's summary.json: median tokens/s (on XLA, measured
between the steps read), compile seconds (Inductor's, or XLA's CompileTime), warm-up
seconds (each phase's first calls, compiling and computing), graphs, recompilations, and
the final training loss (the backends start from the same weights and data).

    .venv-xla/bin/python benchmarks/xla.py [--recipes tiny,pythia-70m]
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

BACKENDS = {
    "cpu eager": ["train.device=cpu", "compile.level=O0"],
    "cpu compiled (O1)": ["train.device=cpu", "compile.level=O1"],
    "xla (CPU client)": ["train.device=xla"],
}
SHAPES = {  # steps, log interval (XLA reads the loss there), overrides
    "tiny": (24, 4, []),
    "pythia-70m": (12, 3, ["data.micro_batch_size=4", "data.global_batch_size=4", "data.seq_len=512"]),
}


def run(recipe: str, backend: str, work: Path) -> dict:
    steps, log_interval, shape = SHAPES[recipe]
    run_dir = work / f"{recipe}-{backend.split()[0]}-{len(backend)}"
    sets = [
        *shape,
        *BACKENDS[backend],
        "train.precision=fp32",
        "optim.warmup_steps=2",
        f"train.steps={steps}",
        f"train.log_interval={log_interval}",
        f"train.eval_interval={steps}",
        f"train.save_interval={steps}",
    ]
    env = dict(os.environ, FRUGALITY_CACHE=str(work / f"cache-{run_dir.name}"), PJRT_DEVICE="CPU")
    command = [sys.executable, "-m", "frugality", "train", recipe, "--run-dir", str(run_dir), "--no-progress"]
    for s in sets:
        command += ["--set", s]
    print(f"{recipe} / {backend} ...", file=sys.stderr, flush=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{recipe} / {backend} failed:\n{done.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    compile_ = summary["compile"]
    return {
        "recipe": recipe,
        "backend": backend,
        "tokens_per_s": summary["median_tokens_per_s"],
        "step_time_s": summary["median_step_time_s"],
        "compile_s": compile_["compile_s"],
        "warm_up_s": compile_["warm_up_s"],
        "graphs": compile_["graphs"],
        "recompiles": compile_["recompiles"],
        "wall_time_s": summary["wall_time_s"],
        "final_train_loss": summary["final_train_loss"],
        "steps": steps,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| recipe | backend | tokens/s | × cpu eager | step s | compile s | warm-up s | graphs | recompiles "
        "| wall s | final loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    eager = {r["recipe"]: r["tokens_per_s"] for r in rows if r["backend"] == "cpu eager"}
    for r in rows:
        ratio = r["tokens_per_s"] / eager[r["recipe"]] if eager.get(r["recipe"]) else None
        lines.append(
            f"| {r['recipe']} | {r['backend']} | {r['tokens_per_s']:,.0f} | "
            f"{f'{ratio:.2f}' if ratio else '—'} | {r['step_time_s']:.3f} | {r['compile_s']:.1f} | "
            f"{r['warm_up_s']:.1f} | {r['graphs']} | {r['recompiles']} | {r['wall_time_s']:.1f} | "
            f"{r['final_train_loss']:.5f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default="tiny,pythia-70m")
    args = parser.parse_args()
    import torch_xla

    rows = []
    with tempfile.TemporaryDirectory() as work:
        for recipe in args.recipes.split(","):
            for backend in BACKENDS:
                rows.append(run(recipe, backend, Path(work)))
    header = (
        f"# XLA's CPU client against the CPU backend, training, fp32\n\n"
        f"{machine_line()} torch-xla {torch_xla.__version__}.\n"
        f"Each row: a fresh `frugality train` process with an empty compile cache. tiny at its "
        f"recipe's shape ({SHAPES['tiny'][0]} steps), Pythia-70m at batch 4 x 512 "
        f"({SHAPES['pythia-70m'][0]} steps). tokens/s: the median over the run's logged steps (on "
        f"XLA, over the steps between two reads of the loss, every log interval). compile s: "
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
        table(rows),
        json.dumps(rows, indent=1),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
