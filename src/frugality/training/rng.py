"""The random-number generators a run's reproducibility rests on: Python's, NumPy's and
torch's (CPU and CUDA), seeded together and saved with every checkpoint."""

from __future__ import annotations

import base64
import random
from typing import cast

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def get_state() -> dict:
    """Every generator's state as plain JSON (checkpoints hold no pickles, docs/security.md)."""
    version, internal, gauss = random.getstate()
    # the legacy tuple, what the default legacy=True gives (numpy's stub types that call as its dict)
    name, keys, pos, has_gauss, cached = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _encode(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_encode(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_state(state: dict) -> None:
    """Restore `get_state()`'s result (or the objects older checkpoints pickled)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(_decode(state["torch"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([_decode(s) for s in state["cuda"]])


def _encode(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _decode(s: str | torch.Tensor) -> torch.Tensor:
    if isinstance(s, torch.Tensor):
        return s
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
