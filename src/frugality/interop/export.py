"""Export a frugality checkpoint as a Hugging Face folder."""

from __future__ import annotations

import tomllib
from pathlib import Path

import torch

from frugality.interop.weights import WeightsSource, load_weights, resolve_source, stored_dtype
from frugality.config.recipe import Recipe
from frugality.data.tokenizer import load_tokenizer
from frugality.errors import UserError
from frugality.interop.hf import export_hf
from frugality.models import build_model


def _recipe_for(source: WeightsSource) -> Recipe:
    """The recipe.toml beside a checkpoint: in the folder itself (imported) or in the run
    directory two levels up (runs/<name>/checkpoints/step_N)."""
    for folder in (source.path, source.path.parent.parent):
        if (folder / "recipe.toml").is_file():
            return Recipe.model_validate(tomllib.loads((folder / "recipe.toml").read_text()))
    raise UserError(f"{source.path}: no recipe.toml beside the checkpoint to describe the model")


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    source = resolve_source(checkpoint)
    if source.kind == "hf":
        raise UserError(f"{checkpoint} is already a Hugging Face folder")
    recipe = _recipe_for(source)
    with torch.device("meta"):
        model = build_model(recipe.model)
    model = model.to_empty(device="cpu").to(stored_dtype(source) or torch.float32)
    load_weights(source, model)
    # transformers' PreTrainedTokenizerFast reads the tokenizers library's JSON directly.
    try:
        files = {"tokenizer.json": load_tokenizer(recipe.data.tokenizer).tokenizer.to_str().encode()}
    except UserError:
        files = {}  # the recipe's tokenizer is gone: export the weights alone
    # Buffers (rotary tables) are not exported; only the loaded parameters are.
    return export_hf(recipe.model, model.state_dict(), out, files)
