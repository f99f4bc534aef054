"""`frugality bench compile`: what each compile level costs and buys.

For each precision and level, two fresh processes train on synthetic batches of the given
shape through the same code path as `frugality train` (CompileSession, warm-up, guard):

- cold: an empty cache; its compile time is what dynamo, AOTAutograd and Inductor report;
- warm: another fresh process, with empty temporary and Inductor directories, fetching the
  entry the cold one published to the cache URL.

Time to the first step is measured from the moment the parent launches the process, so it
includes interpreter start-up, imports and the cache fetch. Tokens/s is the median of the
timed steps of the warm process, which also trains an eager copy of the same model,
alternating steps (A B A B ...), so the speed-up over eager is measured under the same
machine conditions (this machine's step times drift by 10-15% between processes).
Recompiles count compilations after warm-up in both processes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

from frugality.backends import backend
from frugality.config.recipe import Recipe


@dataclass
class CompileRow:
    level: str
    precision: str
    batch: int
    seq: int
    cold_compile_s: float
    cold_first_step_s: float
    warm_first_step_s: float
    warm_compile_s: float
    warm_cache_hits: int
    tokens_per_s: float
    step_time_s: float
    eager_tokens_per_s: float
    recompiles: int
    fallbacks: str
    device: str

    @property
    def speedup(self) -> float:
        return self.tokens_per_s / self.eager_tokens_per_s


def bench_compile(
    recipe: Recipe,
    precisions: list[str],
    levels: list[str],
    batch: int,
    seq: int,
    steps: int = 5,
    cache: str | None = None,
    log=print,
) -> list[CompileRow]:
    rows = []
    for precision in precisions:
        for level in levels:
            url = cache or tempfile.mkdtemp(prefix="frugality-bench-cache-")
            spec = {
                "recipe": recipe.model_dump(mode="json"),
                "precision": precision,
                "level": level,
                "batch": batch,
                "seq": seq,
                "steps": steps,
                "cache": url,
            }
            cold = _run_worker(spec | {"steps": 0} if level != "O0" else spec)
            warm = _run_worker(spec) if level != "O0" else cold
            median = statistics.median(warm["step_times"])
            eager_median = statistics.median(warm["eager_step_times"] or warm["step_times"])
            stats_cold, stats_warm = cold["compile"], warm["compile"]
            rows.append(
                CompileRow(
                    level=level,
                    precision=precision,
                    batch=batch,
                    seq=seq,
                    cold_compile_s=stats_cold.get("compile_s", 0.0),
                    cold_first_step_s=round(cold["first_step_s"], 2),
                    warm_first_step_s=round(warm["first_step_s"], 2),
                    warm_compile_s=stats_warm.get("compile_s", 0.0),
                    warm_cache_hits=stats_warm.get("cache_hits", 0),
                    tokens_per_s=round(batch * seq / median, 1),
                    step_time_s=round(median, 4),
                    eager_tokens_per_s=round(batch * seq / eager_median, 1),
                    recompiles=stats_cold.get("recompiles", 0) + stats_warm.get("recompiles", 0),
                    fallbacks="; ".join(stats_cold.get("fallbacks", [])),
                    device=warm["device"],
                )
            )
            r = rows[-1]
            log(
                f"{precision:9} {level}: cold compile {r.cold_compile_s:6.1f} s, first step "
                f"cold {r.cold_first_step_s:6.1f} s / warm {r.warm_first_step_s:5.1f} s, "
                f"{r.tokens_per_s:8.1f} tokens/s ({r.speedup:.2f}x eager)"
                + (f", fallback: {r.fallbacks}" if r.fallbacks else "")
            )
    return rows


def _run_worker(spec: dict) -> dict:
    """One fresh process, with its own empty temporary directory."""
    with tempfile.TemporaryDirectory(prefix="frugality-bench-tmp-") as tmp:
        env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"} | {"TMPDIR": tmp}
        launched = time.time()
        done = subprocess.run(
            [sys.executable, "-m", "frugality.bench.compile"],
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            env=env,
        )
    if done.returncode != 0:
        raise RuntimeError(f"benchmark worker failed ({spec['precision']}, {spec['level']}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["first_step_s"] = result.pop("first_step_done") - launched
    return result


def markdown_table(rows: list[CompileRow]) -> str:
    """The rows as Markdown. Compile time is what dynamo, AOTAutograd and Inductor report, cold
    (empty cache) and warm (cache fetched: tracing plus loading). Where an O0 row of the same
    precision is present, the warm start's wall-clock overhead is shown too: its first step
    minus the eager process's first step."""
    eager_first = {r.precision: r.cold_first_step_s for r in rows if r.level == "O0"}
    lines = [
        "| precision | level | compile, cold (s) | compile, warm (s) | warm / cold | "
        "first step, cold (s) | first step, warm (s) | warm start overhead vs eager (s) | "
        "overhead / cold compile | tokens/s | vs eager, same process | recompiles | eager fallback |",
        "|" + "---|" * 13,
    ]
    for r in rows:
        compiled = r.level != "O0" and r.cold_compile_s
        overhead = r.warm_first_step_s - eager_first[r.precision] if compiled and r.precision in eager_first else None
        dash = lambda value, spec: "-" if value is None else format(value, spec)
        lines.append(
            f"| {r.precision} | {r.level} | {r.cold_compile_s:.1f} | {r.warm_compile_s:.1f} | "
            f"{dash(r.warm_compile_s / r.cold_compile_s if compiled else None, '.0%')} | "
            f"{r.cold_first_step_s:.1f} | {r.warm_first_step_s:.1f} | {dash(overhead, '.1f')} | "
            f"{dash(overhead / r.cold_compile_s if overhead is not None else None, '.0%')} | "
            f"{r.tokens_per_s:,.0f} | {r.tokens_per_s / r.eager_tokens_per_s:.2f}× | {r.recompiles} | "
            f"{r.fallbacks or '-'} |"
        )
    return "\n".join(lines)


def rows_from_json(text: str) -> list[CompileRow]:
    return [CompileRow(**row) for row in json.loads(text)]


def rows_json(rows: list[CompileRow]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=1)


def _worker() -> None:
    """Child process: the first step (which compiles or loads the graphs), then the timed
    steps; no evaluation, so only the training graphs are compiled."""
    import torch

    from frugality.bench.train import for_shape
    from frugality.config.recipe import CompileConfig
    from frugality.hardware import device_name
    from frugality.runtime.device import resolve_device
    from frugality.runtime.host_memory import keep_freed_memory
    from frugality.runtime.layout import plan_layout
    from frugality.runtime.state import build_state
    from frugality.training.loop import train_step

    spec = json.loads(sys.stdin.read())
    batch, seq = spec["batch"], spec["seq"]
    recipe = for_shape(Recipe.model_validate(spec["recipe"]), spec["precision"], batch, seq)
    recipe = recipe.model_copy(update={"compile": CompileConfig(level=spec["level"], cache=spec["cache"])})
    device = resolve_device(recipe.train.device, what="frugality bench")
    if backend(device).host_memory:
        keep_freed_memory()  # as in training
    layout = plan_layout(recipe, device)
    state = build_state(layout)
    session = state.compiled
    with session.active(state.model):

        def step(i: int, st=state) -> float:
            data = torch.randint(
                0, recipe.model.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(i)
            ).to(device)
            t0 = time.perf_counter()
            st.compiled.run(
                "train", i + 1, lambda: train_step(st, [data]), reset=lambda: st.optimizer.zero_grad(set_to_none=True)
            )
            backend(device).synchronize()
            return time.perf_counter() - t0

        first = step(0)
        first_done = time.time()
        # The eager reference (the same state at O0) is built after the first step, which it must not delay.
        eager_recipe = layout.recipe.model_copy(update={"compile": CompileConfig(level="O0")})
        eager = (
            build_state(replace(layout, recipe=eager_recipe, loads=eager_recipe))
            if session.enabled and spec["steps"]
            else None
        )
        if eager is not None:
            step(0, eager)  # its own first step: allocator warm-up, not timed
        times, eager_times = [], []
        for i in range(1, spec["steps"] + 1):  # A B A B ...
            times.append(step(i))
            if eager is not None:
                eager_times.append(step(i, eager))
    print(
        json.dumps(
            {
                "first_step_done": first_done,
                "step_times": times or [first],
                "eager_step_times": eager_times,
                "compile": session.stats.as_dict(),
                "device": device_name(device),
            }
        )
    )


if __name__ == "__main__":
    _worker()
