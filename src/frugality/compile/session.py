"""One run's compilation: fetch the cache, compile during a warm-up trial, guard afterwards.

`CompileSession` is what `frugality train` and `frugality compile` share, so the warm-up
and the real run compile the same graphs under the same cache key (the trap peer projects'
users fall into: the warm-up writes a cache the run never reads).

1. `start(model)`: point Inductor at a fresh local directory, unpack the cache entry of this
   run's fingerprint into it, mark the blocks for compilation.
2. `warm_up(...)`: a trial forward + backward and an evaluation forward on a zero batch of
   the run's shape. Parameters are not touched; the gradients are zeroed after. Every graph
   the run needs is compiled (or loaded) here. A graph that fails to build is reported by
   name and runs eagerly (`compile.fallback`), or stops the run.
3. `guarded()` / `check(step)`: any compilation after the warm-up (a new shape, a failed
   guard) is reported with dynamo's reason, which names the input and its old and new
   shape; `compile.on_recompile = "error"` refuses to compile it and stops the run.
4. `close()`: publish what was compiled, restore the compiler's stance.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from frugality.compile.cache import CompileCache, cache_url, fingerprint, fresh_inductor_dir
from frugality.compile.levels import apply_level, get_level, graph_name, inductor_options, revert_to_eager
from frugality.errors import UserError


class CompileError(UserError):
    """A graph failed to compile with `compile.fallback = false`."""


class RecompileError(UserError):
    """A compilation after warm-up with `compile.on_recompile = "error"`."""


class RecompileWarning(UserWarning):
    pass


class CompileFallbackWarning(UserWarning):
    pass


@dataclass
class CompileStats:
    level: str
    cache: str | None = None
    fetched: bool = False
    published: bool = False
    graphs: int = 0  # graphs compiled or loaded by Inductor
    cache_hits: int = 0  # graphs loaded from the cache, nothing generated or built
    cache_misses: int = 0  # graphs generated and built here
    compile_s: float = 0.0  # time in dynamo + AOTAutograd + Inductor, cache loads included
    warm_up_s: float = 0.0  # wall time of the warm-up trial
    recompiles: int = 0
    fallbacks: list[str] = field(default_factory=list)
    recompile_reasons: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _counters() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def _metrics() -> list:
    from torch._dynamo.utils import get_compilation_metrics

    return get_compilation_metrics()


class CompileSession:
    def __init__(self, level: str, *, cache: str | None, on_recompile: str, fallback: bool,
                 model_config: dict, micro_batch_size: int, seq_len: int, precision: str,
                 compute_dtype: torch.dtype, device: torch.device) -> None:
        self.level = get_level(level)
        self.enabled = self.level.mode is not None
        self.on_recompile = on_recompile
        self.fallback = fallback
        self.device = device
        self.stats = CompileStats(level=level)
        self.cache: CompileCache | None = None
        if self.enabled:
            self.options = inductor_options(device, compute_dtype)
            fp = fingerprint(model=model_config, micro_batch_size=micro_batch_size, seq_len=seq_len,
                             precision=precision, level=level, device=device, options=self.options)
            self.cache = CompileCache(cache_url(cache), fp)
            self.stats.cache = repr(self.cache)
        self._local = None
        self._previous_dir = None
        self._armed = False
        self._seen_metrics: list = []
        self._start_metrics: list = []
        self._phase = ""
        self._published_misses = 0

    @classmethod
    def for_recipe(cls, recipe, device: torch.device, compute_dtype: torch.dtype) -> "CompileSession":
        c = recipe.compile
        return cls(c.level, cache=c.cache, on_recompile=c.on_recompile, fallback=c.fallback,
                   model_config=recipe.model.model_dump(mode="json"),
                   micro_batch_size=recipe.data.micro_batch_size, seq_len=recipe.data.seq_len,
                   precision=recipe.train.precision, compute_dtype=compute_dtype, device=device)

    # -- 1. start ---------------------------------------------------------------------------
    def start(self, model: torch.nn.Module) -> None:
        if not self.enabled:
            return
        import torch._dynamo
        from torch._inductor.utils import clear_caches

        self._local = fresh_inductor_dir()
        self._previous_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self._local)
        clear_caches()  # in-memory caches remember the previous directory's modules
        torch._dynamo.reset()  # code compiled for an earlier model in this process
        self.stats.fetched = self.cache.fetch(self._local).found
        self._base = _counters()
        self._start_metrics = self._seen_metrics = list(_metrics())
        apply_level(model, self.level, self.options)
        self.model = model

    # -- 2. warm-up -------------------------------------------------------------------------
    def warm_up(self, train_forward: Callable[[], torch.Tensor], eval_forward: Callable[[], object],
                zero_grad: Callable[[], None]) -> None:
        """Compile every graph of the run by running it once: `train_forward` returns a loss
        to differentiate, `eval_forward` runs the evaluation pass."""
        if not self.enabled:
            return
        t0 = time.perf_counter()
        try:
            self._trial(train_forward, eval_forward)
        except Exception as e:  # noqa: BLE001 - anything but a compile failure is re-raised
            if not _is_compile_failure(e):
                raise
            self._fall_back(self._phase, e)
            zero_grad()
            self._trial(train_forward, eval_forward)  # eagerly now: the run's path works
        finally:
            zero_grad()
        self.stats.warm_up_s = time.perf_counter() - t0
        self._account()
        self._seen_metrics = list(_metrics())
        self.publish()
        if self.on_recompile == "error" and not self.stats.fallbacks:
            torch.compiler.set_stance("fail_on_recompile")
        self._armed = True

    def _trial(self, train_forward, eval_forward) -> None:
        self._phase = "forward"
        loss = train_forward()
        self._phase = "backward"
        loss.backward()
        self._phase = "evaluation forward"
        eval_forward()

    def _fall_back(self, phase: str, error: Exception) -> None:
        what = f"the {graph_name(self.model)} graph ({phase}) failed to compile: {_one_line(error)}"
        if not self.fallback:
            raise CompileError(f"compile: {what} (compile.fallback = false)") from None
        warnings.warn(f"compile: {what}; running it eagerly", CompileFallbackWarning, stacklevel=3)
        revert_to_eager(self.model)
        self.stats.fallbacks.append(f"{graph_name(self.model)} ({phase})")

    # -- 3. guard ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def guarded(self, step: int):
        """Around a step or an evaluation: a refused recompilation becomes one clear error."""
        try:
            yield
        except RuntimeError as e:
            if self._armed and "Detected recompile" in str(e):
                reason = _guard_reason(str(e))
                self.stats.recompiles += 1
                self.stats.recompile_reasons.append(reason)
                raise RecompileError(
                    f"compile: step {step} needs a new compilation after warm-up: {reason} "
                    "(compile.on_recompile = \"error\"; the data path's shapes are static, so "
                    "this is a changed batch shape or a new code path)") from None
            raise
        self.check(step)

    def check(self, step: int) -> list[str]:
        """Report compilations since the last check (on_recompile = "warn")."""
        if not self._armed:
            return []
        metrics = list(_metrics())
        new = [m for m in metrics if not any(m is s for s in self._seen_metrics)]
        self._seen_metrics = metrics
        reasons = []
        for m in new:
            if m.co_name is None:  # a lazily compiled backward of a graph already reported
                continue
            reason = f"{m.co_name} ({os.path.basename(m.co_filename or '?')}:{m.co_firstlineno}): " \
                     f"{m.recompile_reason or 'a new graph'}"
            reasons.append(reason)
            warnings.warn(f"compile: recompiled after warm-up at step {step}: {reason}",
                          RecompileWarning, stacklevel=2)
        self.stats.recompiles += len(reasons)
        self.stats.recompile_reasons += reasons
        if new:
            self._account()
        return reasons

    # -- 4. close ---------------------------------------------------------------------------
    def publish(self) -> None:
        """Publish the local directory when it holds graphs the cache lacks."""
        if self.enabled and self.stats.cache_misses > self._published_misses:
            if self.cache.publish(self._local) is not None:
                self.stats.published = True
                self._published_misses = self.stats.cache_misses

    def close(self) -> None:
        if not self.enabled:
            return
        self._account()
        self.publish()
        torch.compiler.set_stance("default")
        self._armed = False

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
        hits, misses = _counters()
        self.stats.cache_hits = hits - self._base[0]
        self.stats.cache_misses = misses - self._base[1]
        self.stats.graphs = self.stats.cache_hits + self.stats.cache_misses
        self.stats.compile_s = round(sum(
            (m.entire_frame_compile_time_s or 0.0) + (m.backward_cumulative_compile_time_us or 0) / 1e6
            for m in _metrics() if not any(m is s for s in self._start_metrics)), 2)


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


def _guard_reason(message: str) -> str:
    """dynamo's guard failures, one line: "tensor 'h' size mismatch at index 0. expected 8, actual 4"."""
    reasons = [line.strip().removeprefix("- ") for line in message.splitlines()
               if line.strip().startswith("- ")]
    # The first failure of each cached graph; the shape mismatch is the informative one.
    shape = [r for r in reasons if "mismatch" in r]
    return "; ".join(shape or reasons[:1]) or message.splitlines()[0]
