"""The compile session of a run on an XLA device. XLA compiles every graph a step traces,
whatever `compile.level` says, so the session's work is the guard: each phase's first call
is its warm-up (its graphs compile there), and a compilation in any later call is a
recompilation, counted from XLA's own metrics and warned about or stopped, as
`compile.on_recompile` says. The shapes are static (packed blocks, length buckets), so one
means a new code path or a changed shape.

XLA's executables can go into frugality's shared cache (a directory or S3, signed with the
fleet key): torch_xla's persistent cache is opened in a fresh local folder before the first
graph, filled from the cache entry, and the entry is published again when the session
compiled something new. The entry's fingerprint is the Inductor cache's (model, batch
shape, precision) with the torch_xla version, the device kind (a TPU's generation, a GPU's
name and capability), the device count and the SPMD layout. With torch_xla 2.9 no PJRT
client loads executables back (the CPU client, TPU: pytorch/xla #9094, CUDA: #8930), and
Neuron's compiler keeps its own cache (`NEURON_COMPILE_CACHE_URL`; docs/xla.md), so
`compile.xla_executables = "auto"` stores none; "on" stores them anyway.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from frugality import xla
from frugality.compile.base import CompileStats, RecompileError, RecompileWarning, SessionBase, T, fleet_key
from frugality.compile.cache import CompileCache, cache_url, fingerprint
from frugality.paths import cache_dir


class XlaCompileSession(SessionBase):
    """The same interface as `CompileSession` (start, run, check, close, cleanup, active,
    outside, stats, warmed), for XLA devices. Each phase warms up over two calls: the first
    optimizer step creates the moments, so the second step's graph is another; and an
    evaluation before any update reads the weights as they were made, one after (bf16
    weights as views of the optimizer's flat buffers) as the update left them."""

    enabled = True
    WARM_UP = 2  # calls per phase (each length bucket's "train@48" its own)

    def __init__(self, *, on_recompile: str, cache: CompileCache | None = None, why_none: str = "") -> None:
        """`cache`: the entry of this run's executables (None: XLA keeps them with the
        process; `why_none` says why). It is opened here: before the process compiles a graph."""
        self.on_recompile = on_recompile
        self.stats = CompileStats(level=f"xla ({xla.client()})", cache=f"none: {why_none}")
        self.warmed: set[str] = set()
        self._calls: dict[str, int] = {}
        self._seen = 0
        self.cache, self._local = cache, None
        if cache is not None:
            # a fresh folder: only what the (verified) entry holds is loaded, and published again
            root = cache_dir() / "xla-executables"
            root.mkdir(parents=True, exist_ok=True)
            self._local = Path(tempfile.mkdtemp(prefix=f"{cache.name}-", dir=root))
            self.stats.fetched = cache.fetch(self._local).found
            if xla.open_executable_cache(str(self._local)):
                self.stats.cache, self.stats.signed = repr(cache), cache.signed
            else:
                self.cache = None
                self.stats.cache = "none: this process compiled a graph before its cache could be opened"
                self.cleanup()
        self._misses = xla.persistent_cache_misses()

    @classmethod
    def for_recipe(cls, recipe, policy_key: str) -> XlaCompileSession:
        c = recipe.compile
        client = xla.requested_client()
        if c.xla_executables == "off":
            return cls(on_recompile=c.on_recompile, why_none="compile.xla_executables is off")
        if c.xla_executables == "auto" and client not in xla.SERIALIZES:
            why = (
                "Neuron's compiler keeps its own cache (NEURON_COMPILE_CACHE_URL)"
                if client == "NEURON"
                else f"XLA's {client} client cannot load executables back with torch_xla {_xla_version()}; "
                "each run compiles in its warm-up"
            )
            return cls(on_recompile=c.on_recompile, why_none=why)
        fp = fingerprint(
            model=recipe.model.model_dump(mode="json"),
            micro_batch_size=recipe.data.micro_batch_size,
            seq_len=recipe.data.seq_len,
            precision=policy_key,
            level="xla",
            device=xla.device(),
            options={
                "torch_xla": xla.version(),
                "kind": xla.kind(),
                "devices": xla.device_count(),
                "spmd": recipe.parallel.data if recipe.parallel.spmd else None,
            },
        )
        cache = CompileCache(cache_url(c.cache), fp, fleet_key(c.cache_key_env))
        return cls(on_recompile=c.on_recompile, cache=cache)

    def start(self, model: torch.nn.Module) -> None:
        self._base = xla.compilations()
        self._seen = _graphs_now()
        self._base_s = xla.compile_seconds()
        self._hits = xla.persistent_cache_hits()
        self._unloadable = xla.persistent_cache_unloadable()

    def run(self, phase: str, step: int, fn: Callable[[], T], reset: Callable[[], None]) -> T:
        """A phase's first calls compile its graphs; a later call that compiles is reported.
        Only what the call itself compiles counts: reading tensors to the host elsewhere (a
        checkpoint's save) compiles small graphs of its own."""
        if phase in self.warmed:
            before = _graphs_now()
            out = fn()
            self._seen = before
            self.check(step)
            return out
        t0 = time.perf_counter()
        out = fn()
        self._calls[phase] = self._calls.get(phase, 0) + 1
        if self._calls[phase] >= self.WARM_UP:
            self.warmed.add(phase)
        self.stats.warm_up_s = round(self.stats.warm_up_s + time.perf_counter() - t0, 3)
        self._seen = _graphs_now()
        self._account()
        return out

    def check(self, step: int) -> list[str]:
        now = _graphs_now()
        new, self._seen = now - self._seen, now
        if not new:
            return []
        self._account()
        reason = f"{new} new XLA graph(s) (a changed shape, or a code path not seen in warm-up)"
        self.stats.recompiles += new
        self.stats.recompile_reasons.append(reason)
        message = f"compile: recompiled after warm-up at step {step}: {reason}"
        if self.on_recompile == "error":
            raise RecompileError(f'{message} (compile.on_recompile = "error")')
        warnings.warn(message, RecompileWarning, stacklevel=3)
        return [reason]

    @contextlib.contextmanager
    def outside(self):
        yield

    def _account(self) -> None:
        # a graph loaded from the persistent cache is not compiled: graphs are both kinds
        self.stats.cache_hits = xla.persistent_cache_hits() - self._hits
        self.stats.cache_misses = xla.compilations() - self._base
        self.stats.graphs = self.stats.cache_misses + self.stats.cache_hits
        self.stats.unloadable = xla.persistent_cache_unloadable() - self._unloadable
        self.stats.compile_s = round(xla.compile_seconds() - self._base_s, 3)

    def close(self) -> None:
        if getattr(self, "_base", None) is not None:
            self._account()
        # what this process compiled and stored beside what it fetched: the entry grows
        if self.cache is not None and xla.persistent_cache_misses() > self._misses and not self.stats.published:
            # (the folder is there: made with the cache, removed by cleanup, after close)
            self.stats.published = self._local is not None and self.cache.publish(self._local) is not None

    def cleanup(self) -> None:
        if self._local is not None:
            shutil.rmtree(self._local, ignore_errors=True)
            self._local = None


def _xla_version() -> str:
    from importlib.metadata import version

    return version("torch_xla")


def _graphs_now() -> int:
    """Graphs this process has compiled or loaded from the persistent cache: a new one of
    either kind after warm-up is a new shape or code path."""
    return xla.compilations() + xla.persistent_cache_hits()
