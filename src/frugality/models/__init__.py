"""Model families. Each family is one readable file of single-device code plus its config."""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import Discriminator, Tag
from torch import nn

from frugality.models.bert import Bert, BertConfig
from frugality.models.gpt_neox import GPTNeoX, GPTNeoXConfig
from frugality.models.llama import Llama, LlamaConfig

FAMILIES = {"gpt-neox": (GPTNeoXConfig, GPTNeoX), "llama": (LlamaConfig, Llama), "bert": (BertConfig, Bert)}


def _family(value: Any) -> str:
    """The recipe's `model.family`, "gpt-neox" when left out."""
    if isinstance(value, dict):
        return value.get("family", "gpt-neox")
    return getattr(value, "family", "gpt-neox")


# The recipe's [model] table validates into one of these, selected by `family`.
ModelConfig = Annotated[
    Union[
        Annotated[GPTNeoXConfig, Tag("gpt-neox")],
        Annotated[LlamaConfig, Tag("llama")],
        Annotated[BertConfig, Tag("bert")],
    ],
    Discriminator(_family),
]


def build_empty(cfg, device="cpu") -> nn.Module:
    """The model's structure to load weights into, without the cost of initialising them:
    built on the meta device, its parameters then allocated (uninitialised) on `device`,
    and the buffers no checkpoint holds (rotary tables) computed there."""
    import torch

    with torch.device("meta"):
        model = build_model(cfg)
    # to_empty gives every parameter storage of its own: tied weights (a tied output layer,
    # BERT's masked-LM decoder) are tied again after it, as built
    first: dict[int, str] = {}
    ties = [(name, first.setdefault(id(p), name)) for name, p in model.named_parameters(remove_duplicate=False)]
    model = model.to_empty(device=device)
    for name, source in ties:
        if name != source:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, model.get_parameter(source))
    for module in model.modules():
        if hasattr(module, "reset_tables"):
            module.reset_tables()
    return model


def build_model(cfg) -> nn.Module:
    """Instantiate the model a config describes, initialised on the current default device."""
    try:
        return FAMILIES[cfg.family][1](cfg)
    except KeyError:
        raise ValueError(f"unknown model family {cfg.family!r}") from None


__all__ = [
    "FAMILIES",
    "Bert",
    "BertConfig",
    "GPTNeoX",
    "GPTNeoXConfig",
    "Llama",
    "LlamaConfig",
    "ModelConfig",
    "build_empty",
    "build_model",
]
