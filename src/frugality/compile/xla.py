"""The compile session of a run on an XLA device. XLA compiles every graph a step traces,
whatever `compile.level` says, so the session's work is the guard: each phase's first call
is its warm-up (its graphs compile there), and a compilation in any later call is a
recompilation, counted from XLA's own metrics and warned about or stopped, as
`compile.on_recompile` says. The shapes are static (packed blocks, length buckets), so one
means a new code path or a changed shape.

XLA's executables are not published to frugality's cache: the CPU client cannot serialize
them, and on Trainium the Neuron compiler keeps its own cache of compiled graphs
(`NEURON_COMPILE_CACHE_URL`, a directory or S3; docs/xla.md).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Callable, TypeVar

import torch

from frugality import xla
from frugality.compile.session import CompileStats, RecompileError, RecompileWarning

T = TypeVar("T")


class XlaCompileSession:
    """The same interface as `CompileSession` (start, run, check, close, cleanup, active,
    outside, stats, warmed), for XLA devices. Each phase warms up over two calls: the first
    optimizer step creates the moments, so the second step's graph is another; and an
    evaluation before any update reads the weights as they were made, one after (bf16
    weights as views of the optimizer's flat buffers) as the update left them."""

    enabled = True
    WARM_UP = 2  # calls per phase (each length bucket's "train@48" its own)

    def __init__(self, *, on_recompile: str) -> None:
        self.on_recompile = on_recompile
        self.stats = CompileStats(level=f"xla ({xla.client()})", cache="none: XLA executables stay with the runtime")
        self.warmed: set[str] = set()
        self._calls: dict[str, int] = {}
        self._seen = 0

    def start(self, model: torch.nn.Module) -> None:
        self._seen = self._base = xla.compilations()
        self._base_s = xla.compile_seconds()

    @contextlib.contextmanager
    def active(self, model: torch.nn.Module):
        self.start(model)
        yield self

    def run(self, phase: str, step: int, fn: Callable[[], T], reset: Callable[[], None]) -> T:
        """A phase's first calls compile its graphs; a later call that compiles is reported.
        Only what the call itself compiles counts: reading tensors to the host elsewhere (a
        checkpoint's save) compiles small graphs of its own."""
        if phase in self.warmed:
            before = xla.compilations()
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
        self._seen = xla.compilations()
        self._account()
        return out

    def check(self, step: int) -> list[str]:
        now = xla.compilations()
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
        self.stats.graphs = self.stats.cache_misses = xla.compilations() - self._base
        self.stats.compile_s = round(xla.compile_seconds() - self._base_s, 3)

    def close(self) -> None:
        if getattr(self, "_base", None) is not None:
            self._account()

    def cleanup(self) -> None:
        pass
