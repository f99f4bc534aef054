"""The optimizer a precision policy calls for: AdamW with GPT-NeoX's parameter groups (no
weight decay on biases and norm weights)."""

from __future__ import annotations

import torch
from torch import nn

from frugality.backends import backend
from frugality.config.recipe import OptimConfig, Recipe
from frugality.precision import PrecisionPolicy, get_policy
from frugality.precision.bf16_adamw import BF16AdamW


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def fused_update(recipe: Recipe, device: torch.device) -> bool:
    """Whether the optimizer runs its one fused pass (`train.fused_optimizer`): not on XLA,
    where the update is traced into the step's graph and XLA fuses it there."""
    return recipe.train.fused_optimizer and backend(device).fused_optimizer


def apply_fused_choice(optimizer: torch.optim.Optimizer, fused: bool) -> None:
    """Put the recipe's fused/foreach choice back after loading a checkpoint: torch's AdamW
    keeps the saved param groups' flags, so a run saved before (or with another setting)
    would otherwise resume with the other implementation. BF16AdamW takes it from the recipe."""
    if type(optimizer) is torch.optim.AdamW:
        for group in optimizer.param_groups:
            group["fused"], group["foreach"] = (True, None) if fused else (None, True)


def build_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    policy: PrecisionPolicy | None = None,
    seed: int = 0,
    fused: bool = True,
    whole: nn.Module | None = None,
) -> torch.optim.Optimizer:
    """`whole`: the whole model where `model` is a part of it (a pipeline stage's), whose
    groups the stochastic rounding's noise indices come from."""
    policy = policy or get_policy("fp32")
    groups = parameter_groups(model, cfg.weight_decay)
    if policy.storage_dtype == torch.bfloat16:
        index_of = None
        if whole is not None:
            places = {}
            for group in parameter_groups(whole, cfg.weight_decay):
                offset = 0
                for p in group["params"]:
                    places[id(p)] = offset
                    offset += p.numel()
            index_of = lambda p: places[id(p)]  # noqa: E731
        # One fused pass per group over flat bf16 buffers, float32 math, rounded back.
        assert policy.rounding is not None  # every policy with bf16 storage names its rounding
        return BF16AdamW(
            groups,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            rounding=policy.rounding,
            seed=seed,
            fused=fused,
            index_of=index_of,
        )
    # fused: torch's one-pass AdamW kernel (CPU and CUDA): on a 2-core EPYC it updates
    # Pythia-70m in 0.06 s against foreach's 0.29 s (benchmarks/step_profile.py). foreach
    # (one multi-tensor kernel per group) where fused is switched off.
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused or None, foreach=not fused or None
    )
