"""What every compile session shares (`compile.session`'s for Inductor, `compile.xla`'s for
XLA devices): their interface, their statistics, their errors and warnings, the fleet key
that signs a shared cache's entries, and the context manager a run opens one with."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol, TypeVar

import torch

from frugality.compile.cache import KEY_ENV_VAR
from frugality.errors import FrugalityWarning, UserError

T = TypeVar("T")


class CompileError(UserError):
    """A graph failed to compile with `compile.fallback = false`."""


class RecompileError(UserError):
    """A compilation after warm-up with `compile.on_recompile = "error"`."""


class RecompileWarning(FrugalityWarning):
    """A compilation after warm-up, with `compile.on_recompile = "warn"`."""


class CompileFallbackWarning(FrugalityWarning):
    """A graph failed to compile and runs eagerly."""


@dataclass
class CompileStats:
    level: str
    cache: str | None = None
    signed: bool = False  # a fleet key was set: entries signed when published, verified when fetched
    fetched: bool = False
    published: bool = False
    graphs: int = 0  # graphs compiled or loaded by Inductor
    cache_hits: int = 0  # graphs loaded from the cache, nothing generated or built
    cache_misses: int = 0  # graphs generated and built here
    compile_s: float = 0.0  # time in dynamo + AOTAutograd + Inductor, cache loads included
    warm_up_s: float = 0.0  # wall time of each phase's first call (compiling and computing)
    recompiles: int = 0
    unloadable: int = 0  # XLA: executables found in the cache that this PJRT client cannot load (the CPU client)
    fallbacks: list[str] = field(default_factory=list)
    recompile_reasons: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


MIN_KEY_LENGTH = 16


def fleet_key(variable: str) -> bytes | None:
    """The fleet key from the environment variable `compile.cache_key_env` names. A recipe
    chooses the variable, so it may not weaken verification: with FRUGALITY_CACHE_KEY set it
    cannot name another variable, and a key too short to be a secret (a variable such as
    HOME, guessable by whoever wrote the recipe) is refused."""
    if variable != KEY_ENV_VAR and os.environ.get(KEY_ENV_VAR):
        raise UserError(
            f"compile.cache_key_env = {variable!r} while {KEY_ENV_VAR} is set: a recipe may not "
            "choose another cache key (docs/security.md)"
        )
    key = os.environ.get(variable, "")
    if key and len(key) < MIN_KEY_LENGTH:
        raise UserError(
            f"the compile cache key in ${variable} has {len(key)} characters; a fleet key needs at "
            f"least {MIN_KEY_LENGTH} random ones (docs/security.md)"
        )
    return key.encode() or None


class Session(Protocol):
    """A run's compile session, as the training loop and the benchmarks use it: opened around
    the run (`active`: started on the model, then closed, what was compiled published, and
    cleaned up), each phase run through it (its first calls the warm-up, later ones guarded
    and `check`ed), and code that is another's kept `outside` it. `compile.session`'s
    (Inductor) and `compile.xla`'s (XLA devices) both are one; `compile.factory` picks."""

    enabled: bool
    stats: CompileStats
    warmed: set[str]

    def start(self, model: torch.nn.Module) -> None: ...

    def run(self, phase: str, step: int, fn: Callable[[], T], reset: Callable[[], None]) -> T: ...

    def check(self, step: int) -> list[str]: ...

    def outside(self) -> contextlib.AbstractContextManager: ...

    def active(self, model: torch.nn.Module) -> contextlib.AbstractContextManager: ...

    def close(self) -> None: ...

    def cleanup(self) -> None: ...


class SessionBase:
    """`active()` for a session class that has start, close and cleanup."""

    def start(self, model: torch.nn.Module) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def cleanup(self) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def active(self, model: torch.nn.Module):
        """The session around a run: started on `model`, then closed (what was compiled
        published) and cleaned up however the block ends."""
        try:
            self.start(model)
            yield self
        finally:
            self.close()
            self.cleanup()
