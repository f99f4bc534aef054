"""Model families. Each family is one readable file of single-device code plus its config."""

from __future__ import annotations

from typing import Annotated, Any, TypeAlias

from pydantic import Discriminator, Tag

from frugality.models.bert import Bert, BertConfig
from frugality.models.families import DECODERS, ENCODERS, SPECS, Family, family
from frugality.models.gpt_neox import GPTNeoX, GPTNeoXConfig
from frugality.models.llama import Llama, LlamaConfig

# The model classes, for code that reaches into a model's own attributes (`config`, `layers`).
Model: TypeAlias = GPTNeoX | Llama | Bert
Decoder: TypeAlias = GPTNeoX | Llama  # the causal LMs: an output layer, a KV cache

FAMILIES = {name: (f.config, f.model) for name, f in SPECS.items()}  # name -> (config class, model class)


def _family(value: Any) -> str:
    """The recipe's `model.family`, "gpt-neox" when left out."""
    if isinstance(value, dict):
        return value.get("family", "gpt-neox")
    return getattr(value, "family", "gpt-neox")


# The recipe's [model] table validates into one of these, selected by `family`.
ModelConfig = Annotated[
    Annotated[GPTNeoXConfig, Tag("gpt-neox")]
    | Annotated[LlamaConfig, Tag("llama")]
    | Annotated[BertConfig, Tag("bert")],
    Discriminator(_family),
]


def build_model(cfg) -> Model:
    """Instantiate the model a config describes, initialised on the current default device."""
    try:
        return FAMILIES[cfg.family][1](cfg)
    except KeyError:
        raise ValueError(f"unknown model family {cfg.family!r}") from None


__all__ = [
    "DECODERS",
    "ENCODERS",
    "FAMILIES",
    "SPECS",
    "Family",
    "family",
    "Bert",
    "BertConfig",
    "Decoder",
    "GPTNeoX",
    "GPTNeoXConfig",
    "Llama",
    "LlamaConfig",
    "Model",
    "ModelConfig",
    "build_model",
]
