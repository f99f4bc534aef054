"""The optimizer a recipe asks for: fused AdamW for float32 storage, foreach when switched
off, and the recipe's choice kept over a loaded checkpoint's."""

import torch

from frugality.config.recipe import OptimConfig
from frugality.runtime.optim import apply_fused_choice, build_optimizer


def _flags(optimizer):
    return {(g["fused"], g["foreach"]) for g in optimizer.param_groups}


def test_float32_storage_takes_fused_adamw_and_keeps_the_choice_over_a_checkpoint():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    fused, foreach = (build_optimizer(model, OptimConfig(), fused=f) for f in (True, False))
    assert _flags(fused) == {(True, None)} and _flags(foreach) == {(None, True)}
    model(torch.randn(2, 4)).sum().backward()
    foreach.step()
    fused.load_state_dict(foreach.state_dict())  # a checkpoint saved with foreach
    assert _flags(fused) == {(None, True)}  # torch keeps the saved flags ...
    apply_fused_choice(fused, True)
    assert _flags(fused) == {(True, None)}  # ... the recipe's choice is put back
    fused.step()  # and the fused kernel takes the loaded moments
