"""Model families. Each family is one readable file of single-device code plus its config."""

from __future__ import annotations

from torch import nn

from frugality.models.gpt_neox import GPTNeoX, GPTNeoXConfig

# The recipe's [model] table validates into one of these (selected by `family`).
ModelConfig = GPTNeoXConfig


def build_model(cfg: ModelConfig) -> nn.Module:
    """Instantiate the model a config describes, initialised on the current default device."""
    if cfg.family == "gpt-neox":
        return GPTNeoX(cfg)
    raise ValueError(f"unknown model family {cfg.family!r}")


__all__ = ["GPTNeoX", "GPTNeoXConfig", "ModelConfig", "build_model"]
