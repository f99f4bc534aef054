"""Compile-first execution: compile levels, a shared persistent cache, a recompilation guard.

- `levels`: what `compile.level` O0 / O1 / O2 compile (the transformer blocks) and how.
- `cache`: the fingerprint that keys compiled code, and the entry at a directory or URL.
- `base`: what every session shares (the `Session` interface, statistics, errors, the
  fleet key); `factory.open_session`: the session a run's device asks for.
- `session`: one run's warm-up, fallback, guard and publication with Inductor, shared by
  `frugality compile` and `frugality train` so that both use the same graphs under the same key.
- `xla`: on an XLA device, the guard of XLA's own compilations and its executables' cache.

The ahead-of-time warm-up itself (`frugality compile`) is a short training run:
`frugality.training.ahead`.
"""

from frugality.compile.levels import LEVELS

__all__ = ["LEVELS"]
