"""One run's compilation: fetch the cache, compile while warming up, guard afterwards.

`CompileSession` is what `frugality train` and `frugality compile` share, so the warm-up
and the real run compile the same graphs under the same cache key (the trap peer projects'
users fall into: the warm-up writes a cache the run never reads).

1. `start(model)`: point Inductor at a fresh local directory, unpack the cache entry of this
   run's fingerprint into it, mark the blocks for compilation.
2. `run("train" | "eval", ...)`: the first call of each phase is its warm-up. The real first
   step and the first evaluation compile (or load) their graphs; no extra trial pass is
   paid. A graph that fails to build is reported by name, the partial work is undone and
   the call runs again eagerly (`compile.fallback`), or the run stops.
3. Every later call is guarded: a compilation it causes (a new shape, a failed guard) is
   reported with dynamo's reason, which names the input with its expected and actual
   shape; `compile.on_recompile = "error"` stops the run with that message.
4. `close()`: publish what was compiled; `cleanup()` removes the local directory.

Why no precompiled header: Inductor keeps its C++ precompiled header (155 MB here) outside
its cache directory, so every fresh machine rebuilds it when it loads cached kernels (8 s
of a 12 s warm start, measured on the micro recipe). Without it a warm start took 3.5 s and
a cold compile 53 s instead of 40 s: the right trade when one compile serves a fleet.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from frugality.compile.base import (
    CompileError,
    CompileFallbackWarning,
    CompileStats,
    RecompileError,
    RecompileWarning,
    SessionBase,
    T,
    fleet_key,
)
from frugality.compile.cache import KEY_ENV_VAR, CompileCache, cache_url, fingerprint, fresh_inductor_dir
from frugality.compile.levels import (
    apply_level,
    check_backend,
    get_level,
    graph_name,
    inductor_options,
    revert_to_eager,
)


def _counters() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def _metrics() -> list:
    from torch._dynamo.utils import get_compilation_metrics

    return get_compilation_metrics()


class CompileSession(SessionBase):
    def __init__(
        self,
        level: str,
        *,
        cache: str | None,
        on_recompile: str,
        fallback: bool,
        model_config: dict,
        micro_batch_size: int,
        seq_len: int,
        precision: str,
        compute_dtype: torch.dtype,
        device: torch.device,
        cache_key_env: str = KEY_ENV_VAR,
        backend: str = "inductor",
        checkpointing: str = "none",
    ) -> None:
        self.level = get_level(level)
        self.enabled = self.level.mode is not None
        self.on_recompile = on_recompile
        self.fallback = fallback
        self.backend = backend
        self.stats = CompileStats(level=level if backend == "inductor" else f"{level} ({backend})")
        self.cache: CompileCache | None = None
        self.options: dict = {}
        if self.enabled and backend != "inductor":
            check_backend(backend)
            self.stats.cache = f"none: the shared cache holds Inductor's graphs, not {backend}'s"
        elif self.enabled:
            self.options = inductor_options(device, compute_dtype, recomputes=checkpointing != "none")
            fp = fingerprint(
                model=model_config,
                micro_batch_size=micro_batch_size,
                seq_len=seq_len,
                precision=precision,
                level=level,
                device=device,
                options=self.options,
                checkpointing=checkpointing,
            )
            key = fleet_key(cache_key_env)  # never logged or stored
            self.cache = CompileCache(cache_url(cache), fp, key)
            self.stats.cache = repr(self.cache)
            self.stats.signed = self.cache.signed
        self._local: Path | None = None
        self._previous_dir: str | None = None
        self._base: tuple[int, int] | None = None  # the cache counters at the start
        self.warmed: set[str] = set()  # phases past their first call
        self._seen_metrics: list = []
        self._start_metrics: list = []
        self._published_misses = 0

    @classmethod
    def for_recipe(cls, recipe, device: torch.device, policy, checkpointing: str = "none") -> CompileSession:
        """Inductor's session for `recipe` on `device` (a CPU or a GPU), under the resolved
        precision `policy` and activation checkpointing mode (`compile.factory.open_session`
        picks XLA's on an XLA device)."""
        c = recipe.compile
        return cls(
            c.level,
            cache=c.cache,
            on_recompile=c.on_recompile,
            fallback=c.fallback,
            cache_key_env=c.cache_key_env,
            backend=c.backend,
            model_config=recipe.model.model_dump(mode="json"),
            micro_batch_size=recipe.data.micro_batch_size,
            seq_len=recipe.data.seq_len,
            precision=policy.key,
            compute_dtype=policy.graph_dtype,
            device=device,
            checkpointing=checkpointing,
        )

    # -- 1. start ---------------------------------------------------------------------------
    def start(self, model: torch.nn.Module) -> None:
        if not self.enabled:
            return
        import torch._dynamo
        from torch._inductor.utils import clear_caches

        if self.cache is not None:  # Inductor's: a fresh directory, published at the end
            self._local = fresh_inductor_dir()
            self._previous_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self._local)
            clear_caches()  # in-memory caches remember the previous directory's modules
        torch._dynamo.reset()  # code compiled for an earlier model in this process
        # (the directory is made with the cache, above)
        self.stats.fetched = self.cache.fetch(self._local).found if self.cache and self._local else False
        self._base = _counters()
        self._start_metrics = self._seen_metrics = list(_metrics())
        apply_level(model, self.level, self.options, self.backend)
        self.model = model

    # -- 2. warm-up and 3. guard -------------------------------------------------------------
    def run(self, phase: str, step: int, fn: Callable[[], T], reset: Callable[[], None]) -> T:
        """Run one `phase` of the run ("train" for a step, "eval" for an evaluation).

        The first call of a phase is its warm-up: its graphs compile here, or load from the
        cache. If one fails to build, `reset()` undoes the partial work (gradients) and the
        call runs again eagerly (or, with `compile.fallback = false`, the run stops). Later
        calls are guarded: any compilation they cause is a recompilation, reported with
        dynamo's reason (which input, expected and actual shape)."""
        if not self.enabled:
            return fn()
        if phase in self.warmed:
            out = fn()
            self.check(step)
            return out
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - anything but a compile failure is re-raised
            if not _is_compile_failure(e):
                raise
            self._fall_back(phase, e)
            reset()
            out = fn()
        self.warmed.add(phase)
        self.stats.warm_up_s = round(self.stats.warm_up_s + time.perf_counter() - t0, 3)
        self._seen_metrics = list(_metrics())
        self._account()
        self.publish()
        return out

    def _fall_back(self, phase: str, error: Exception) -> None:
        what = f"the {graph_name(self.model)} graph ({phase}) failed to compile: {_one_line(error)}"
        if not self.fallback:
            raise CompileError(f"compile: {what} (compile.fallback = false)") from None
        warnings.warn(f"compile: {what}; running it eagerly", CompileFallbackWarning, stacklevel=3)
        revert_to_eager(self.model)
        self.stats.fallbacks.append(f"{graph_name(self.model)} ({phase})")

    def check(self, step: int) -> list[str]:
        """Compilations since the last check, after warm-up: warned about, or an error."""
        metrics = list(_metrics())
        new = [m for m in metrics if not any(m is s for s in self._seen_metrics)]
        self._seen_metrics = metrics
        if not new:
            return []
        self._account()
        reasons = [
            f"{m.co_name} ({os.path.basename(m.co_filename or '?')}:{m.co_firstlineno}): "
            f"{_guard_reason(m.recompile_reason) if m.recompile_reason else 'a new graph'}"
            for m in new
            if m.co_name is not None  # None: a backward compiled with its forward
        ]
        self.stats.recompiles += len(reasons)
        self.stats.recompile_reasons += reasons
        for reason in reasons:
            message = f"compile: recompiled after warm-up at step {step}: {reason}"
            if self.on_recompile == "error":
                raise RecompileError(
                    f'{message} (compile.on_recompile = "error"; the data path keeps shapes '
                    "static, so a changed batch shape or a new code path caused it)"
                )
            warnings.warn(message, RecompileWarning, stacklevel=3)
        return reasons

    @contextlib.contextmanager
    def outside(self):
        """Code run in this block is another's (a peer's step in `frugality bench train`):
        what it compiles is not this session's. It is not counted, not taken for a
        recompilation, and not published with this session's graphs (Inductor writes it to
        the directory it used before this session)."""
        if not self.enabled:
            yield
            return
        before, (hits, misses) = list(_metrics()), _counters()
        ours = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if self._previous_dir is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = self._previous_dir
        try:
            yield
        finally:
            if ours is not None:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = ours
            theirs = [m for m in _metrics() if not any(m is b for b in before)]
            self._seen_metrics = self._seen_metrics + theirs
            self._start_metrics = self._start_metrics + theirs  # out of compile_s too
            after_hits, after_misses = _counters()
            assert self._base is not None  # set by start(): this runs within a started session
            self._base = (self._base[0] + after_hits - hits, self._base[1] + after_misses - misses)

    # -- 4. close ---------------------------------------------------------------------------
    def publish(self) -> None:
        """Publish the local directory when it holds graphs the cache lacks (not after a
        failed compile: the next run would only fail the same way)."""
        if (
            self.cache
            and self.stats.cache_misses > self._published_misses
            and not self.stats.fallbacks
            and self._local is not None  # (made at start with the cache; removed by cleanup, after close)
            and self.cache.publish(self._local) is not None
        ):
            self.stats.published = True
            self._published_misses = self.stats.cache_misses

    def close(self) -> None:
        if not self.enabled or self._base is None:  # never started (or its start failed)
            return
        self._account()
        self.publish()

    def cleanup(self) -> None:
        """Remove the local directory (after the compiled modules are no longer needed)."""
        if self._local is not None:
            shutil.rmtree(self._local, ignore_errors=True)
            if self._previous_dir is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = self._previous_dir
            self._local = None

    def _account(self) -> None:
        assert self._base is not None  # set by start()
        hits, misses = _counters()
        self.stats.cache_hits = hits - self._base[0]
        self.stats.cache_misses = misses - self._base[1]
        self.stats.graphs = self.stats.cache_hits + self.stats.cache_misses
        if self.backend != "inductor":  # no Inductor counters: dynamo's own frames
            # (a backward's record, co_name None, belongs to its forward's graph)
            self.stats.graphs = sum(
                1 for m in _metrics() if m.co_name is not None and not any(m is s for s in self._start_metrics)
            )
        self.stats.compile_s = round(
            sum(
                (m.entire_frame_compile_time_s or 0.0) + (m.backward_cumulative_compile_time_us or 0) / 1e6
                for m in _metrics()
                if not any(m is s for s in self._start_metrics)
            ),
            2,
        )


def _is_compile_failure(error: Exception) -> bool:
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InductorError

    return isinstance(error, (BackendCompilerFailed, InductorError)) or "CompileError" in type(error).__name__


def _one_line(error: Exception) -> str:
    """The line of a compiler's output that says what went wrong."""
    text = str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if " error: " in line or line.startswith("error:"):
            return f"{type(error).__name__}: {line[:300]}"
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def _guard_reason(reason: str) -> str:
    """dynamo's first guard failure, without its cache-entry prefix ("0/1: "):
    "tensor 'h' size mismatch at index 0. expected 8, actual 4"."""
    line = reason.strip().splitlines()[0] if reason.strip() else reason
    head, sep, rest = line.partition(": ")
    return rest if sep and "/" in head and head.replace("/", "").isdigit() else line
