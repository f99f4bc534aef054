"""Model families. Each family is one readable file of single-device code plus its config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, TypeAlias

from pydantic import Discriminator, Tag

from frugality.models.bert import Bert, BertConfig
from frugality.models.gpt_neox import GPTNeoX, GPTNeoXConfig
from frugality.models.llama import Llama, LlamaConfig

if TYPE_CHECKING:
    import torch

# The model classes, for code that reaches into a model's own attributes (`config`, `layers`).
Model: TypeAlias = GPTNeoX | Llama | Bert
Decoder: TypeAlias = GPTNeoX | Llama  # the causal LMs: an output layer, a KV cache

FAMILIES = {"gpt-neox": (GPTNeoXConfig, GPTNeoX), "llama": (LlamaConfig, Llama), "bert": (BertConfig, Bert)}


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


def build_empty(cfg, device: torch.device | str = "cpu") -> Model:
    """The model's structure to load weights into, without the cost of initialising them:
    built on the meta device, its parameters then allocated (uninitialised) on `device`,
    and the buffers no checkpoint holds (rotary tables) computed there."""
    import torch

    from frugality.models.materialize import allocate

    with torch.device("meta"):
        model = build_model(cfg)
    return allocate(model, device)


def build_model(cfg) -> Model:
    """Instantiate the model a config describes, initialised on the current default device."""
    try:
        return FAMILIES[cfg.family][1](cfg)
    except KeyError:
        raise ValueError(f"unknown model family {cfg.family!r}") from None


__all__ = [
    "FAMILIES",
    "Bert",
    "BertConfig",
    "Decoder",
    "GPTNeoX",
    "GPTNeoXConfig",
    "Llama",
    "LlamaConfig",
    "Model",
    "ModelConfig",
    "build_empty",
    "build_model",
]
