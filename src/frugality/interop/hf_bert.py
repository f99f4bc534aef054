"""State-dict and config mapping between `frugality.models.Bert` and Hugging Face
`BertModel` (no prefix, as sentence-embedding checkpoints such as all-MiniLM-L6-v2 store
it) or `BertForMaskedLM` (`bert.` prefix and `cls.predictions.*`)."""

from __future__ import annotations

from collections.abc import Set
from typing import Any

import torch

from frugality.interop.names import NameMap
from frugality.models.bert import BertConfig

NAMES = NameMap(
    family="BERT",
    top=(
        ("embeddings.word.weight", "embeddings.word_embeddings.weight"),
        ("embeddings.position.weight", "embeddings.position_embeddings.weight"),
        ("embeddings.token_type.weight", "embeddings.token_type_embeddings.weight"),
        ("embeddings.norm.weight", "embeddings.LayerNorm.weight"),
        ("embeddings.norm.bias", "embeddings.LayerNorm.bias"),
        ("pooler.weight", "pooler.dense.weight"),
        ("pooler.bias", "pooler.dense.bias"),
        ("mlm.dense.weight", "cls.predictions.transform.dense.weight"),
        ("mlm.dense.bias", "cls.predictions.transform.dense.bias"),
        ("mlm.norm.weight", "cls.predictions.transform.LayerNorm.weight"),
        ("mlm.norm.bias", "cls.predictions.transform.LayerNorm.bias"),
        ("mlm.decoder.bias", "cls.predictions.bias"),
    ),
    layer=(
        ("attn.query", "attention.self.query"),
        ("attn.key", "attention.self.key"),
        ("attn.value", "attention.self.value"),
        ("attn.out", "attention.output.dense"),
        ("attn_norm", "attention.output.LayerNorm"),
        ("up", "intermediate.dense"),
        ("down", "output.dense"),
        ("mlp_norm", "output.LayerNorm"),
    ),
    theirs_layer="encoder.layer.{i}.{module}.{kind}",
    # Buffers and tied copies that checkpoints may carry.
    ignored=r"(position_ids|token_type_ids|cls\.predictions\.decoder\.(weight|bias))$",
)


FAMILY, MODEL_TYPE = "bert", "bert"  # frugality's family, transformers' model_type


def to_hf(state: dict[str, torch.Tensor], cfg: BertConfig) -> dict[str, torch.Tensor]:
    """Names as `BertModel` (encoder only) or `BertForMaskedLM` (with the MLM head, under
    a `bert.` prefix) save them. The decoder weight is the word embedding: transformers
    re-ties it."""
    # The embedding head and the temperature are not BertModel's: sentence-transformers'
    # Dense modules carry the head (frugality.interop.sentence_transformers).
    out = NAMES.to_theirs(
        {
            k: v
            for k, v in state.items()
            if k != "mlm.decoder.weight" and not k.startswith("head.") and k != "logit_scale"
        }
    )
    if cfg.mlm_head:
        out = {(k if k.startswith("cls.") else "bert." + k): v for k, v in out.items()}
    return out


def from_hf(state: dict[str, torch.Tensor], cfg: BertConfig) -> dict[str, torch.Tensor]:
    """Either layout -> ours, keeping only the heads `cfg` has."""
    out = NAMES.to_ours({k.removeprefix("bert."): v for k, v in state.items()})
    out = {
        k: v
        for k, v in out.items()
        if not (k.startswith("pooler.") and not cfg.pooler) and not (k.startswith("mlm.") and not cfg.mlm_head)
    }
    if cfg.mlm_head:
        out["mlm.decoder.weight"] = out["embeddings.word.weight"]
    return out


def config_to_hf(cfg: BertConfig) -> dict[str, Any]:
    return {
        "architectures": ["BertForMaskedLM" if cfg.mlm_head else "BertModel"],
        "model_type": "bert",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "type_vocab_size": cfg.type_vocab_size,
        "layer_norm_eps": cfg.layer_norm_eps,
        "hidden_act": "gelu",
        "position_embedding_type": "absolute",
        "pad_token_id": 0,
        "tie_word_embeddings": True,
    }


def config_from_hf(config: dict[str, Any], state_keys: Set[str] = frozenset()) -> BertConfig:
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type {config['position_embedding_type']!r} is not supported")
    if config.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (only exact gelu)")
    has = lambda suffix: any(k.removeprefix("bert.").startswith(suffix) for k in state_keys)
    return BertConfig(
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        max_seq_len=config.get("max_position_embeddings", 512),
        type_vocab_size=config.get("type_vocab_size", 2),
        layer_norm_eps=config.get("layer_norm_eps", 1e-12),
        pooler=has("pooler."),
        mlm_head=has("cls.predictions."),
    )
