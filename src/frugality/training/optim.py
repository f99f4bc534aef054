"""AdamW with GPT-NeoX's parameter groups: no weight decay on biases and norm weights."""

from __future__ import annotations

import torch
from torch import nn

from frugality.config.recipe import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # foreach: one fused multi-tensor kernel per group rather than a Python loop per tensor.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=True)
