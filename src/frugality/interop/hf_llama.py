"""State-dict and config mapping between `frugality.models.Llama` and Hugging Face
`transformers.LlamaForCausalLM`. Same tensor layouts (transformers' q/k rows are already
in rotate-half order), so the mapping is a renaming."""

from __future__ import annotations

from collections.abc import Set
from typing import Any

import torch

from frugality.interop.names import NameMap
from frugality.models.llama import LlamaConfig

NAMES = NameMap(
    family="Llama",
    top=(
        ("embed.weight", "model.embed_tokens.weight"),
        ("final_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
    ),
    layer=(
        ("attn_norm", "input_layernorm"),
        ("mlp_norm", "post_attention_layernorm"),
        ("attn.q", "self_attn.q_proj"),
        ("attn.k", "self_attn.k_proj"),
        ("attn.v", "self_attn.v_proj"),
        ("attn.o", "self_attn.o_proj"),
        ("mlp.gate", "mlp.gate_proj"),
        ("mlp.up", "mlp.up_proj"),
        ("mlp.down", "mlp.down_proj"),
    ),
    theirs_layer="model.layers.{i}.{module}.{kind}",
    ignored=r"rotary_emb\.inv_freq$",
)


FAMILY, MODEL_TYPE = "llama", "llama"  # frugality's family, transformers' model_type


def to_hf(state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    if cfg.tie_embeddings:  # transformers ties lm_head to embed_tokens itself
        state = {k: v for k, v in state.items() if k != "output.weight"}
    return NAMES.to_theirs(state)


def from_hf(state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    out = NAMES.to_ours(state)
    if cfg.tie_embeddings:
        out["output.weight"] = out["embed.weight"]
    return out


def config_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,  # transformers 4.x
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},  # 5.x
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "head_dim": cfg.head_size,
    }


def config_from_hf(config: dict[str, Any], state_keys: Set[str] = frozenset()) -> LlamaConfig:
    rope = config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", (config.get("rope_scaling") or {}).get("rope_type", "default"))
    if rope_type not in ("default", None):
        raise ValueError(f"rope scaling {rope_type!r} is not supported yet")
    heads = config["num_attention_heads"]
    if config.get("head_dim") not in (None, config["hidden_size"] // heads):
        raise ValueError("head_dim other than hidden_size / num_attention_heads is not supported yet")
    return LlamaConfig(
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads", heads),
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        max_seq_len=config.get("max_position_embeddings", 2048),
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        tie_embeddings=config.get("tie_word_embeddings", False),
    )
