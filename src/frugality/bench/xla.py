"""XLA beside the CPU backend, eager and compiled (`frugality bench train --device xla`,
`benchmarks/xla.py`): each row a fresh `frugality train` process of this interpreter (so
every row has the same torch: .venv-xla's) with an empty compile cache. Tokens/s: the
median of the run's logged records after its warm-up steps (on XLA a record times the
steps since the previous read, so a record is counted only when those all follow the
warm-up); compile seconds (Inductor's, or XLA's CompileTime), warm-up seconds, graphs and
recompilations from its summary.json, with the wall time, the precision as it resolved and
the final training loss (the backends start from the same weights and data)."""

from __future__ import annotations

import json
import os
import statistics
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
# (the table's order: the CPU rows, then XLA's)


def bench_xla(
    recipe: str,
    overrides: list[str],
    steps: int,
    log_interval: int,
    precision: str = "fp32",
    log=print,
    warmup: int = 2,
) -> list[dict]:
    """One row a backend for `recipe` (a name or file) with `overrides`: `warmup` steps, then
    `steps` timed ones, the loss read every `log_interval` (on XLA, the steps between reads
    are timed together). XLA's row runs first: a set-up XLA cannot run fails before the
    CPU backend's compile."""
    import importlib.util

    if importlib.util.find_spec("torch_xla") is None:
        raise UserError("bench train --device xla runs in the XLA environment: .venv-xla/bin/frugality (docs/xla.md)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="frugality-bench-xla-") as work:
        for number, backend in enumerate(("xla", "cpu eager", "cpu compiled (O1)")):
            log(f"{recipe} / {backend} ...")
            folder = Path(work) / str(number)
            rows.append(_row(recipe, backend, overrides, warmup, steps, log_interval, precision, folder))
    return rows[1:] + rows[:1]  # the CPU rows first, as the table reads


def _row(recipe, backend, overrides, warmup, steps, log_interval, precision, work: Path) -> dict:
    total = warmup + steps
    sets = [  # the run's shape as asked; what the benchmark needs after, so that it holds
        *overrides,
        *BACKENDS[backend],
        f"train.precision={precision}",
        f"train.steps={total}",
        f"optim.warmup_steps={min(2, total)}",
        f"train.log_interval={log_interval}",
        f"train.eval_interval={total}",
        f"train.save_interval={total}",
    ]
    env = dict(os.environ, FRUGALITY_CACHE=str(work / "cache"), PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
    command = [sys.executable, "-m", "frugality", "train", recipe, "--run-dir", str(work / "run"), "--no-progress"]
    done = subprocess.run([*command, *(a for s in sets for a in ("--set", s))], env=env, capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1].removeprefix("error: ")
        raise UserError(f"bench train --device xla: the {backend} run failed: {last}")
    summary = json.loads((work / "run" / "summary.json").read_text())
    stats = summary["compile"]
    rates, times = _after_warm_up(work / "run" / "metrics.jsonl", warmup)
    return {
        "recipe": recipe,
        "precision": summary["precision"],
        "backend": backend if backend != "xla" else stats["level"],  # "xla (CPU)": the client
        "tokens_per_s": statistics.median(rates),
        "step_time_s": statistics.median(times),
        "compile_s": stats["compile_s"],
        "warm_up_s": stats["warm_up_s"],
        "graphs": stats["graphs"],
        "recompiles": stats["recompiles"],
        "wall_time_s": summary["wall_time_s"],
        "final_train_loss": summary["final_train_loss"],
        "steps": steps,
        "warmup": warmup,
    }


def _after_warm_up(log: Path, warmup: int) -> tuple[list[float], list[float]]:
    """tokens/s and step seconds of the logged records whose steps all follow the warm-up."""
    rates, times, previous = [], [], 0
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") != "train" or "tokens_per_s" not in record:
            continue
        if previous >= warmup:
            rates.append(record["tokens_per_s"])
            times.append(record["step_time_s"])
        previous = record["step"]
    if not rates:
        raise UserError(f"bench train --device xla: no step logged after the {warmup} warm-up steps; log more often")
    return rates, times


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
