"""One spec per model family: what the rest of frugality asks of a family, in one place,
rather than checking its name. Adding a family: its model file, a `Family` here, its
Hugging Face adapter in `interop/`, its tensor-parallel plan in
`distributed.tensor_parallel.PLANS` where `tensor_parallel` says so."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from frugality.models.bert import Bert, BertConfig
from frugality.models.gpt_neox import GPTNeoX, GPTNeoXConfig
from frugality.models.llama import Llama, LlamaConfig


@dataclass(frozen=True)
class Family:
    name: str  # the recipe's `model.family`
    config: type  # its pydantic config
    model: type  # its nn.Module
    decoder: bool  # a causal LM (an output layer, a KV cache): trains next-token, generates, serves completions;
    # else an encoder: masked-LM and contrastive training, embeddings
    hf_model_type: str  # transformers' `model_type`
    tensor_parallel: bool  # split over tensor ranks (its plan: `distributed.tensor_parallel.PLANS`)
    pipelined: bool  # cut into pipeline stages at its blocks
    mlp_width: str  # the config's attribute for the MLP's hidden width (what tensor parallel splits)
    kv_heads: str | None = None  # the config's attribute for key-value heads (grouped-query attention)

    def width_of_mlp(self, config: Any) -> int:
        return getattr(config, self.mlp_width)

    def heads_to_split(self, config: Any) -> dict[str, int]:
        """The head counts tensor parallel divides among its ranks."""
        heads = {"heads": config.num_heads}
        if self.kv_heads is not None:
            heads["key-value heads"] = getattr(config, self.kv_heads)
        return heads


SPECS = {
    f.name: f
    for f in (
        Family("gpt-neox", GPTNeoXConfig, GPTNeoX, True, "gpt_neox", True, True, "ffn_size"),
        Family("llama", LlamaConfig, Llama, True, "llama", True, True, "intermediate_size", kv_heads="kv_heads"),
        Family("bert", BertConfig, Bert, False, "bert", False, False, "intermediate_size"),
    )
}
DECODERS = tuple(name for name, f in SPECS.items() if f.decoder)
ENCODERS = tuple(name for name, f in SPECS.items() if not f.decoder)


def family(of: Any) -> Family:
    """The spec of a family, by its name or a model config's `family`."""
    name = of if isinstance(of, str) else of.family
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r} (have: {', '.join(SPECS)})") from None


def names(predicate) -> str:
    """The families a predicate holds for, for a message: "gpt-neox and llama"."""
    chosen = [name for name, f in SPECS.items() if predicate(f)]
    return " and ".join(chosen) if len(chosen) < 3 else ", ".join(chosen[:-1]) + " and " + chosen[-1]
