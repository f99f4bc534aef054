"""Compile-first execution: compile levels, a shared persistent cache, a recompilation guard.

- `levels`: what `compile.level` O0 / O1 / O2 compile (the transformer blocks) and how.
- `cache`: the fingerprint that keys compiled code, and the entry at a directory or URL.
- `session`: one run's warm-up, fallback, guard and publication, shared by `frugality
  compile` and `frugality train` so that both use the same graphs under the same key.

The ahead-of-time warm-up itself (`frugality compile`) is a short training run:
`frugality.training.ahead`.
"""

from frugality.compile.levels import LEVELS

__all__ = ["LEVELS"]
