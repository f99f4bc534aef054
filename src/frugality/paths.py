"""Where frugality caches what it can rebuild: tokenized corpora, measured device peaks,
compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$FRUGALITY_CACHE, else $XDG_CACHE_HOME/frugality, else ~/.cache/frugality."""
    if root := os.environ.get("FRUGALITY_CACHE"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "frugality"
