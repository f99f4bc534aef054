"""State-dict and config mapping between `frugality.models.GPTNeoX` and Hugging Face
`transformers.GPTNeoXForCausalLM`.

The tensors are laid out identically (including the fused QKV rows, [heads, (q, k, v),
head_size]), so the mapping is a renaming; nothing is permuted.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Any

import torch

from frugality.interop.names import NameMap
from frugality.models.gpt_neox import GPTNeoXConfig

NAMES = NameMap(
    family="GPT-NeoX",
    top=(
        ("embed.weight", "gpt_neox.embed_in.weight"),
        ("final_norm.weight", "gpt_neox.final_layer_norm.weight"),
        ("final_norm.bias", "gpt_neox.final_layer_norm.bias"),
        ("output.weight", "embed_out.weight"),
    ),
    layer=(
        ("attn_norm", "input_layernorm"),
        ("mlp_norm", "post_attention_layernorm"),
        ("attn.qkv", "attention.query_key_value"),
        ("attn.out", "attention.dense"),
        ("mlp.up", "mlp.dense_h_to_4h"),
        ("mlp.down", "mlp.dense_4h_to_h"),
    ),
    theirs_layer="gpt_neox.layers.{i}.{module}.{kind}",
    # Buffers that old transformers releases saved and newer ones ignore.
    ignored=r"\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)$",
)


FAMILY, MODEL_TYPE = "gpt-neox", "gpt_neox"  # frugality's family, transformers' model_type


def to_hf(
    state: dict[str, torch.Tensor], cfg: GPTNeoXConfig | None = None, output_name: str = "embed_out.weight"
) -> dict[str, torch.Tensor]:
    """frugality GPTNeoX state dict -> GPTNeoXForCausalLM state dict.

    The output layer is named as on disk (`embed_out.weight`, which every transformers
    release reads); transformers 5.x names the module `lm_head` in memory, so pass
    `output_name="lm_head.weight"` to `load_state_dict` into a live 5.x model.
    """
    return NAMES.to_theirs(state, top={"output.weight": output_name})


def from_hf(state: dict[str, torch.Tensor], cfg: GPTNeoXConfig | None = None) -> dict[str, torch.Tensor]:
    """GPTNeoXForCausalLM state dict (on disk or live) -> frugality GPTNeoX state dict."""
    return NAMES.to_ours(state, top={"lm_head.weight": "output.weight"})


def config_to_hf(cfg: GPTNeoXConfig) -> dict[str, Any]:
    """A `config.json` for transformers; both the 4.x keys (`rotary_pct`, `rotary_emb_base`)
    and the 5.x `rope_parameters` are written so either release reads it."""
    return {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.ffn_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rotary_pct": cfg.rotary_pct,
        "rotary_emb_base": cfg.rotary_base,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rotary_base,
            "partial_rotary_factor": cfg.rotary_pct,
        },
        "use_parallel_residual": cfg.parallel_residual,
        "layer_norm_eps": cfg.layer_norm_eps,
        "hidden_act": "gelu",
        "attention_bias": True,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }


def config_from_hf(config: dict[str, Any], state_keys: Set[str] = frozenset()) -> GPTNeoXConfig:
    """From a transformers `config.json` (4.x or 5.x keys)."""
    if config.get("tie_word_embeddings"):
        raise ValueError("tied input/output embeddings are not supported for GPT-NeoX")
    rope = config.get("rope_parameters") or {}
    return GPTNeoXConfig(
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        intermediate_size=config.get("intermediate_size"),
        vocab_size=config["vocab_size"],
        max_seq_len=config.get("max_position_embeddings", 2048),
        rotary_pct=rope.get("partial_rotary_factor", config.get("rotary_pct", 0.25)),
        rotary_base=rope.get("rope_theta", config.get("rotary_emb_base", 10000.0)),
        parallel_residual=config.get("use_parallel_residual", True),
        layer_norm_eps=config.get("layer_norm_eps", 1e-5),
    )
