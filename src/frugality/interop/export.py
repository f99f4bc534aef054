"""Export a frugality checkpoint as a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch

from frugality.data.tokenizer import load_tokenizer
from frugality.errors import UserError
from frugality.interop.hf import export_hf
from frugality.interop.sentence_transformers import module_files
from frugality.interop.weights import file_beside, load_weights, recipe_beside, resolve_source, stored_dtype
from frugality.models import BertConfig, build_model
from frugality.models.families import family


def embedding_length(source) -> int | None:
    """The length texts are cut to, as the sentence-transformers config beside the weights
    says (one the run carried from the model it started from)."""
    from frugality.interop.sentence_transformers import read_json

    found = file_beside(source, "sentence_bert_config.json")
    length = (read_json(found) or {}).get("max_seq_length") if found is not None else None
    return length if isinstance(length, int) else None


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    source = resolve_source(checkpoint, "checkpoint")  # export's own argument, not train's --init-from
    if source.kind == "hf":
        raise UserError(f"{checkpoint} is already a Hugging Face folder")
    recipe = recipe_beside(source)
    with torch.device("meta"):
        model = build_model(recipe.model)
    model = model.to_empty(device="cpu").to(stored_dtype(source) or torch.float32)
    load_weights(source, model)
    # transformers' PreTrainedTokenizerFast reads the tokenizers library's JSON directly.
    try:
        files = {"tokenizer.json": load_tokenizer(recipe.data.tokenizer).tokenizer.to_str().encode()}
    except UserError:
        files = {}  # the recipe's tokenizer is gone: export the weights alone
    state = model.state_dict()
    if not family(recipe.model).decoder:  # an embedding model: sentence-transformers loads it as it embeds
        files.update(
            module_files(cast(BertConfig, recipe.model), state, embedding_length(source) or recipe.model.max_seq_len)
        )
    # Buffers (rotary tables) are not exported; only the loaded parameters are.
    return export_hf(recipe.model, state, out, files)
