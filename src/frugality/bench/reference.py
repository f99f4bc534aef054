"""The reference a user would otherwise run: transformers' GPTNeoXForCausalLM (or
LlamaForCausalLM for a Llama recipe) with torch.optim.AdamW, set up the way its
documentation does it for each precision."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from frugality.config.recipe import Recipe
from frugality.errors import UserError
from frugality.interop import hf_gpt_neox, hf_llama
from frugality.models.families import DECODERS
from frugality.runtime.optim import parameter_groups

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def build_transformers(recipe: Recipe, precision: str, device: torch.device, fused_adamw: bool = False):
    """(model, optimizer, autocast context) for transformers at `precision`.

    fp32: plain. amp-bf16: bf16 autocast over fp32 weights. bf16 and bf16-sr: weights cast
    to bf16 with plain AdamW (transformers has no stochastic rounding; this is what
    `model.to(torch.bfloat16)` gives a user). `fused_adamw`: the fused AdamW kernel, which
    `TrainingArguments` picks by default on torch >= 2.8 ("adamw_torch_fused").
    """
    try:
        import transformers
    except ImportError:
        raise UserError("the transformers reference needs `pip install transformers`") from None
    model_class, config = hf_model_class_and_config(transformers, recipe)
    config._attn_implementation = "sdpa"  # transformers' default on PyTorch 2
    model = model_class(config).to(device)
    if precision in ("bf16", "bf16-sr"):
        model = model.to(torch.bfloat16)
    elif precision not in ("fp32", "amp-bf16"):
        raise UserError(f"no transformers reference for precision {precision!r}")
    model.train()
    o = recipe.optim
    optimizer = torch.optim.AdamW(
        parameter_groups(model, o.weight_decay), lr=o.lr, betas=o.betas, eps=o.eps, fused=fused_adamw or None
    )
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if precision == "amp-bf16" else contextlib.nullcontext()
    )
    return model, optimizer, autocast


def hf_model_class_and_config(transformers, recipe: Recipe) -> tuple[type[torch.nn.Module], PretrainedConfig]:
    """transformers' causal-LM class and config for the recipe's architecture (the class as
    an nn.Module's: its `to`, wrapped by functools.wraps, does not bind as a method for pyright)."""
    family = recipe.model.family
    if family not in DECODERS:
        raise UserError(f"no transformers reference for model family {family!r} ({' and '.join(DECODERS)} have one)")
    interop, config_class, model_class = (
        (hf_gpt_neox, transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM)
        if family == "gpt-neox"
        else (hf_llama, transformers.LlamaConfig, transformers.LlamaForCausalLM)
    )
    fields = {k: v for k, v in interop.config_to_hf(recipe.model).items() if k not in ("architectures", "model_type")}
    return model_class, config_class(**fields)


def transformers_step(model, optimizer, autocast, batch: torch.Tensor, grad_clip: float) -> float:
    """One training step the transformers way: labels in, shifted loss out."""
    inputs = batch[:, :-1]
    with autocast:
        loss = model(input_ids=inputs, labels=inputs).loss
    loss.backward()
    if grad_clip > 0:  # 0: off (TrainingArguments' max_grad_norm=0 likewise)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()
