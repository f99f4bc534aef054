"""XLA beside the CPU backend, eager and compiled (`frugality bench train --device xla`,
`benchmarks/xla.py`): each row a fresh `frugality train` process of this interpreter (so
every row has the same torch: .venv-xla's) with an empty compile cache, its figures read
from the run's summary.json: median tokens/s (on XLA, between the steps read), compile
seconds (Inductor's, or XLA's CompileTime), warm-up seconds, graphs, recompilations, wall
time and the final training loss (the backends start from the same weights and data)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from frugality.errors import UserError

BACKENDS = {
    "cpu eager": ["train.device=cpu", "compile.level=O0"],
    "cpu compiled (O1)": ["train.device=cpu", "compile.level=O1"],
    "xla": ["train.device=xla"],
}


def bench_xla(
    recipe: str, overrides: list[str], steps: int, log_interval: int, precision: str = "fp32", log=print
) -> list[dict]:
    """One row a backend for `recipe` (a name or file) with `overrides`, `steps` steps, the
    loss read every `log_interval` (on XLA, the steps between reads are timed together)."""
    import importlib.util

    if importlib.util.find_spec("torch_xla") is None:
        raise UserError("bench train --device xla runs in the XLA environment: .venv-xla/bin/frugality (docs/xla.md)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="frugality-bench-xla-") as work:
        for number, backend in enumerate(BACKENDS):
            log(f"{recipe} / {backend} ...")
            rows.append(_row(recipe, backend, overrides, steps, log_interval, precision, Path(work) / str(number)))
    return rows


def _row(recipe, backend, overrides, steps, log_interval, precision, work: Path) -> dict:
    sets = [
        *overrides,
        *BACKENDS[backend],
        f"train.precision={precision}",
        f"train.steps={steps}",
        f"optim.warmup_steps={min(2, steps)}",
        f"train.log_interval={log_interval}",
        f"train.eval_interval={steps}",
        f"train.save_interval={steps}",
    ]
    env = dict(os.environ, FRUGALITY_CACHE=str(work / "cache"), PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
    command = [sys.executable, "-m", "frugality", "train", recipe, "--run-dir", str(work / "run"), "--no-progress"]
    done = subprocess.run([*command, *(a for s in sets for a in ("--set", s))], env=env, capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"bench train --device xla: the {backend} run failed: {last}")
    summary = json.loads((work / "run" / "summary.json").read_text())
    stats = summary["compile"]
    return {
        "recipe": recipe,
        "precision": precision,
        "backend": backend if backend != "xla" else stats["level"],  # "xla (CPU)": the client
        "tokens_per_s": summary["median_tokens_per_s"],
        "step_time_s": summary["median_step_time_s"],
        "compile_s": stats["compile_s"],
        "warm_up_s": stats["warm_up_s"],
        "graphs": stats["graphs"],
        "recompiles": stats["recompiles"],
        "wall_time_s": summary["wall_time_s"],
        "final_train_loss": summary["final_train_loss"],
        "steps": steps,
    }


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| recipe | precision | backend | tokens/s | × cpu eager | step s | compile s | warm-up s | graphs "
        "| recompiles | wall s | final loss |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    eager = {(r["recipe"], r["precision"]): r["tokens_per_s"] for r in rows if r["backend"] == "cpu eager"}
    for r in rows:
        base = eager.get((r["recipe"], r["precision"]))
        ratio = r["tokens_per_s"] / base if base else None
        lines.append(
            f"| {r['recipe']} | {r['precision']} | {r['backend']} | {r['tokens_per_s']:,.0f} | "
            f"{f'{ratio:.2f}' if ratio else '—'} | {r['step_time_s']:.3f} | {r['compile_s']:.1f} | "
            f"{r['warm_up_s']:.1f} | {r['graphs']} | {r['recompiles']} | {r['wall_time_s']:.1f} | "
            f"{r['final_train_loss']:.5f} |"
        )
    return "\n".join(lines)
